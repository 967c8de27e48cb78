"""A model's weights out of trainloop: one ``.safetensors`` file that other tools read.

``trainloop export CHECKPOINT --output model.safetensors`` and
:class:`~trainloop.hooks.export.ExportHook` write it. ``safetensors.torch.load_file`` on the
result gives exactly the weights, keys as the unwrapped model names them (no ``_orig_mod.`` or
``module.``), tied weights included: safetensors refuses two names for one tensor, so each tied
name after the first is stored as its own copy and the tie is recorded in the metadata
(``"tied"``: ``{"lm_head.weight": "transformer.wte.weight"}``), for a loader that re-ties.

The metadata (strings, as safetensors stores them): ``format`` (``"pt"``), ``step``,
``settings_sha256`` (the SHA-256 of the run's settings JSON, when known), ``weights``
(``"model"`` or the EMA hook's), ``trainloop_version``, ``tied``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping

import torch

from trainloop.checkpoint.errors import CheckpointSaveError
from trainloop.checkpoint.storage import atomic_file
from trainloop.checkpoint.weights import read_weights
from trainloop.location import Location, location
from trainloop.version import __version__

__all__ = ["export_checkpoint", "save_weights", "settings_hash"]


def settings_hash(settings_json: str | None) -> str | None:
    """The SHA-256 (hex) of a run's settings JSON, or ``None`` when unknown."""
    return None if settings_json is None else hashlib.sha256(settings_json.encode()).hexdigest()


def save_weights(
    state_dict: Mapping[str, torch.Tensor],
    output: str | Location,
    *,
    step: int | None = None,
    settings_json: str | None = None,
    weights: str = "model",
) -> dict[str, str]:
    """Write ``state_dict`` to ``output`` as one ``.safetensors`` file, atomically.

    Args:
        state_dict: Parameter and buffer names to tensors (any device; copied to the CPU).
        output: The file to write (its directory is created), or a URL (uploaded once complete).
        step: The step the weights are of.
        settings_json: The run's settings as JSON (hashed into the metadata).
        weights: What the weights are (``"model"``, an EMA hook's name).

    Returns:
        The metadata written.

    Raises:
        CheckpointSaveError: The file cannot be written; the message names it (not the
            temporary file it was being written to).
    """
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    tied: dict[str, str] = {}
    seen: dict[tuple[int, int, tuple[int, ...], tuple[int, ...], torch.dtype], str] = {}
    for key, value in state_dict.items():
        tensor = value.detach()
        view = (
            tensor.untyped_storage().data_ptr(),
            int(tensor.storage_offset()),
            tuple(tensor.shape),
            tuple(tensor.stride()),
            tensor.dtype,
        )
        if tensor.numel() and view in seen:
            tied[key] = seen[view]
            tensor = tensor.clone()  # its own storage: safetensors refuses a shared one
        elif tensor.numel():
            seen[view] = key
        tensors[key] = tensor.cpu().contiguous()
    metadata = {
        "format": "pt",
        "weights": weights,
        "trainloop_version": __version__,
        "tied": json.dumps(tied, sort_keys=True),
    }
    if step is not None:
        metadata["step"] = str(step)
    digest = settings_hash(settings_json)
    if digest is not None:
        metadata["settings_sha256"] = digest
    try:
        with atomic_file(location(output)) as tmp:  # never a half-written file under the name
            save_file(_unshared(tensors), str(tmp), metadata=metadata)
    except OSError as error:
        raise CheckpointSaveError(f"{output}: cannot write: {error.strerror or error}") from error
    except Exception as error:  # safetensors raises its own SafetensorError, naming the temporary file
        raise CheckpointSaveError(f"{output}: cannot write: {_without_temporary(str(error))}") from error
    return metadata


def _without_temporary(message: str) -> str:
    """Safetensors' message without its ``at path "…/.tmpXXXX"`` (a name the user never gave)."""
    return message.split(" at path ", 1)[0]


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copy the tensors that still share storage with another, which safetensors refuses.

    These are overlapping slices of one buffer; exact ties were copied already.
    """
    owners: dict[int, str] = {}
    result: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        ptr = tensor.untyped_storage().data_ptr()
        if tensor.numel() and ptr in owners:
            tensor = tensor.clone()
        owners.setdefault(ptr, key)
        result[key] = tensor
    return result


def export_checkpoint(checkpoint: str | Location, output: str | Location, weights: str = "model") -> dict[str, str]:
    """Export a checkpoint's model (or EMA) weights, consolidated, to one ``.safetensors`` file.

    Args:
        checkpoint: A checkpoint directory (full or sharded: every rank's shards are joined),
            a checkpoints root or a workspace (its latest checkpoint); local or a URL.
        output: The ``.safetensors`` file to write.
        weights: ``"model"``, ``"ema"`` or an EMA hook's name.

    Returns:
        The metadata written.

    Raises:
        trainloop.checkpoint.CheckpointError: The checkpoint is missing, corrupt or holds no such weights.
    """
    found = read_weights(checkpoint, weights)
    return save_weights(found.state_dict, output, step=found.step, settings_json=found.settings_json, weights=weights)
