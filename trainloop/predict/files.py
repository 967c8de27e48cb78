"""The predictions file: ``.safetensors`` (the default) or ``.pt``, written atomically.

``<workspace>/predictions.safetensors`` unless an output is given. ``safetensors.torch.load_file``
(or ``torch.load`` for ``.pt``/``.pth``) gives back a dict of name to tensor, row ``i`` of each
being item ``i`` of the dataset. A safetensors file also carries metadata (strings): ``items``,
``step``, ``weights``, ``checkpoint`` (when one was restored) and ``trainloop_version``. An existing
file is replaced in one rename (logged at INFO): a predict run on a newer checkpoint is the usual
reason to run again. Whether the file can be written is checked before anything is built
(``output_problem``): a predict run never predicts everything only to find it cannot save it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from trainloop.checkpoint.storage import atomic_file
from trainloop.core.workspace import file_problem
from trainloop.distributed.ranks import gather_from_ranks, is_rank_zero, world_size
from trainloop.version import __version__

__all__ = [
    "DEFAULT_NAME", "FORMATS", "PredictionsFileError", "output_problem", "predictions_path", "write_predictions"
]

DEFAULT_NAME = "predictions.safetensors"
"""The file a predict run writes in its workspace when no output is given."""

FORMATS = {".safetensors": "safetensors", ".pt": "pt", ".pth": "pt"}
"""The output file's suffix to the format written."""


def predictions_path(output: str | Path | None, workspace: Path | None) -> Path | None:
    """Where a predict run writes: ``output`` as given, else ``<workspace>/predictions.safetensors``.

    ``None`` when neither is set (the outputs are only returned).

    Raises:
        ValueError: ``output`` is empty, a directory, or its suffix is none of ``FORMATS``.
    """
    if output is None:
        return None if workspace is None else workspace / DEFAULT_NAME
    if not str(output).strip():
        raise ValueError("the predictions output is empty: give a .safetensors or .pt file")
    path = Path(output)
    if path.is_dir():
        raise ValueError(f"the predictions output {str(output)!r} is a directory: give a .safetensors or .pt file")
    if path.suffix not in FORMATS:
        raise ValueError(
            f"the predictions output {str(output)!r} ends in {path.suffix or 'no suffix'!r}: "
            f"give a file ending in {', '.join(FORMATS)}"
        )
    return path


class PredictionsFileError(OSError):
    """The predictions file cannot be written; the message names it."""


def output_problem(path: Path | None) -> str | None:
    """Why rank 0 could not write the predictions file ``path`` (``None``: it can, or there is none).

    Rank 0 tries to create a file beside it (and removes it); under several ranks every rank
    learns its answer (a collective: every rank calls this).
    """
    problem = file_problem(path, probe=True) if path is not None and is_rank_zero() else None
    if world_size() > 1:
        problem = next((found for found in gather_from_ranks(problem) if found is not None), None)
    return problem


def write_predictions(outputs: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """Write ``outputs`` to ``path`` in the format its suffix names (see ``FORMATS``), atomically.

    Args:
        outputs: Name to tensor, one row per item (CPU tensors).
        path: The file; its directory is created.
        metadata: Stored in a safetensors file's header (``trainloop_version`` is added); a
            ``.pt`` file holds the tensors only.

    Raises:
        PredictionsFileError: The file cannot be written (a full disk, say); nothing is left under its name.
    """
    tensors = {name: value.contiguous() for name, value in outputs.items()}
    try:
        with atomic_file(path) as tmp:
            if FORMATS[path.suffix] == "pt":
                torch.save(tensors, tmp)
            else:
                from safetensors.torch import save_file

                save_file(tensors, str(tmp), metadata={**metadata, "trainloop_version": __version__})
    except Exception as error:  # OSError, torch's RuntimeError, safetensors' SafetensorError
        said = error.strerror if isinstance(error, OSError) and error.strerror else str(error).split(" at path ")[0]
        raise PredictionsFileError(f"{path}: cannot write the predictions: {said}") from error
