"""A model's weights alone: read from a checkpoint or a state-dict file, and loaded into a model.

``init_from`` (see :class:`~trainloop.settings.init_from.InitFromSettings`) starts a run from
them; ``trainloop export`` (:mod:`trainloop.checkpoint.export`) writes them out. Sources:

- a trainloop checkpoint directory, full or sharded (a checkpoints root or a workspace: its
  latest), whose model or EMA weights are taken;
- a ``.safetensors`` file;
- a ``.pt`` / ``.pth`` / ``.bin`` file holding a state dict (read with ``weights_only=True``),
  or a dict with the state dict under ``"model"`` or ``"state_dict"`` (nanoGPT's ``ckpt.pt``).

Each may be local or on object storage (a URL: see :mod:`trainloop.checkpoint.storage`). The
suffix names the format; a local file whose bytes are the other format's is refused with a line
that says so (``weights_file_problem`` tells it from the first bytes, for the preflight).
"""

from __future__ import annotations

import logging
import tempfile
import zipfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainloop.checkpoint import storage
from trainloop.checkpoint.errors import CheckpointError
from trainloop.checkpoint.files import checkpoint_format, read_checkpoint
from trainloop.checkpoint.loading import load_file
from trainloop.checkpoint.manager import latest_checkpoint
from trainloop.checkpoint.manifest import read_metadata
from trainloop.checkpoint.storage import MANIFEST
from trainloop.location import Location, UrlPath, location
from trainloop.utils import unwrap_model

__all__ = [
    "Weights",
    "find_checkpoint",
    "load_weights",
    "read_weights",
    "tied_keys",
    "weights_file_problem",
    "weights_problem",
]

_MODEL_FILE = "model.pt"
_REST = "training_state"
#: The prefixes wrappers put before a model's keys: torch.compile's, DDP's and AveragedModel's.
_WRAPPER_PREFIXES = ("_orig_mod.", "module.")


@dataclass
class Weights:
    """A model's state dict and where it came from.

    Attributes:
        state_dict: Parameter and buffer names to tensors (on the CPU).
        source: The file or checkpoint directory read.
        step: The checkpoint's step, if the source is a checkpoint.
        epoch: The checkpoint's epoch (full passes over the data completed), if the source is a checkpoint.
        settings_json: The settings of the run that saved the checkpoint, if known.
        metadata: String metadata of a ``.safetensors`` file.
    """

    state_dict: dict[str, torch.Tensor]
    source: Location
    step: int | None = None
    settings_json: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    epoch: int | None = None


def find_checkpoint(path: Location, logger: logging.Logger | None = None) -> Location:
    """The checkpoint directory ``path`` names.

    Itself, or a checkpoints root's (or a workspace's ``checkpoints/``) latest complete checkpoint.

    Raises:
        CheckpointError: Nothing there is a checkpoint; the message names ``path``.
    """
    return _find_checkpoint(path, logger)[0]


def _find_checkpoint(path: Location, logger: logging.Logger | None = None) -> tuple[Location, bool]:
    """:func:`find_checkpoint`, and whether the checkpoint was verified on the way (a root's latest is)."""
    if storage.is_file(path / MANIFEST):
        return path, False
    for root in _roots(path):
        found = latest_checkpoint(root, logger=logger)
        if found is not None:
            return found, True
    raise CheckpointError(
        f"{path}: not a checkpoint directory, nor a checkpoints root or workspace with a complete checkpoint"
    )


def _roots(path: Location) -> list[Location]:
    """The checkpoints roots ``path`` may be: itself, or a workspace's ``checkpoints/``, where they hold any."""
    return [
        root for root in (path, path / "checkpoints")
        if any(name == storage.LATEST or storage.is_step_name(name) for name in storage.names(root))
    ]


def _content_format(path: Path) -> str | None:
    """What the first bytes of the file ``path`` say it is: ``"safetensors"``, ``"zip"``, ``"pickle"`` or ``None``.

    A safetensors file starts with its header's length (8 bytes, little-endian) and the header's
    ``{``; torch.save writes a zip archive (before torch 1.6, a pickle).
    """
    with path.open("rb") as file:
        head = file.read(9)
    if head[:4] == b"PK\x03\x04":
        return "zip"
    if head[:1] == b"\x80":
        return "pickle"
    if len(head) == 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") <= path.stat().st_size - 8:
        return "safetensors"
    return None


def _misnamed(path: Path, found: str | None) -> str | None:
    """What to say when the bytes of ``path`` are the other format's than its suffix names."""
    if path.suffix == ".safetensors" and found in ("zip", "pickle"):
        return "it is a torch.save file, not a .safetensors file: name it .pt"
    if path.suffix != ".safetensors" and found == "safetensors":
        return f"it is a .safetensors file under a {path.suffix or 'suffix-less'} name: name it .safetensors"
    return None


def weights_file_problem(path: Location) -> str | None:
    """Why the weights in ``path`` cannot be read, from the names and first bytes of its files (no tensor is read).

    ``None`` when it looks readable. A directory must be a checkpoint, or a checkpoints root or
    workspace that holds one (verified when it is read); a ``.safetensors`` file's header is read
    and checked; a torch file must be a complete zip archive (or a pickle). The preflight asks it,
    so that a damaged ``init_from`` is refused before anything is written. On object storage only
    the names are checked (reading a file there is a download).
    """
    if storage.is_dir(path):
        if storage.is_file(path / MANIFEST) or _roots(path):
            return None
        return f"{str(path)!r} is not a checkpoint directory, nor a checkpoints root or workspace with checkpoints"
    if isinstance(path, UrlPath):
        return None
    try:
        if path.stat().st_size == 0:
            return f"{str(path)!r} is empty"
        found = _content_format(path)
        misnamed = _misnamed(path, found)
        if misnamed is not None:
            return f"{str(path)!r}: {misnamed}"
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt"):  # reads and checks the header alone
                pass
            return None
        if found == "pickle" or (found == "zip" and zipfile.is_zipfile(path)):
            return None
        return f"{str(path)!r} is not a file torch.save wrote, or it is damaged"
    except OSError as error:
        return f"{str(path)!r}: cannot read it: {error.strerror or error}"
    except Exception as error:  # noqa: BLE001  # safetensors raises its own SafetensorError
        return f"{str(path)!r} is not a readable .safetensors file ({error})"


def weights_problem(path: Location, weights: str) -> str | None:
    """Why ``read_weights(path, weights)`` would fail, where the files' names tell (no tensor is read).

    A weights file holds only a model; a full checkpoint's averaged weights are an entry file
    beside ``model.pt`` (a sharded checkpoint's entries are inside its shards: ``None``, told
    when it is read).
    """
    if weights == "model":
        return None
    if storage.is_file(path):
        return f"weights={weights!r} needs a checkpoint; {str(path)!r} is a weights file (it holds one model)"
    try:
        directory = find_checkpoint(path)
    except CheckpointError:
        return None  # said when it is read, with the reason
    if checkpoint_format(directory) != "full":
        return None
    stems = (name.removesuffix(".pt") for name in storage.names(directory) if name.endswith(".pt"))
    entries = sorted(stem for stem in stems if stem not in ("model", _REST))
    if (weights == "ema" and entries) or weights in entries:
        return None
    listed = ", ".join(entries) or "none"
    return f"weights={weights!r}, but {str(directory)!r} holds no such averaged weights (its hook entries: {listed})"


def read_weights(
    path: str | Location, weights: str = "model", *, verified: bool = False, logger: logging.Logger | None = None
) -> Weights:
    """Read a model's weights from a checkpoint (verified against its manifest) or a file.

    Args:
        path: A checkpoint directory, checkpoints root or workspace; or a ``.safetensors`` or
            ``.pt`` file; local, or a URL (its filesystem configured by fsspec's configuration,
            or a :class:`~trainloop.location.UrlPath` made with its options).
        weights: From a checkpoint: ``"model"``, ``"ema"`` (the one EMA hook's averaged
            weights) or the name of the hook whose averaged weights to take.
        verified: ``path`` is a checkpoint directory verified already (``latest_checkpoint``
            found it): its files are not hashed again.
        logger: Where a skipped (corrupt) checkpoint is reported.

    Raises:
        CheckpointError: The path is missing, corrupt, of another format than its suffix says,
            or holds no such weights; the message names it.
    """
    path = location(path)
    if not storage.exists(path):
        raise CheckpointError(f"{path}: no such file or directory")
    if storage.is_dir(path):
        directory, checked = _find_checkpoint(path, logger)
        return _from_checkpoint(directory, weights, verified=verified or checked)
    if weights != "model":
        raise CheckpointError(
            f"{path}: a weights file holds one model's weights; weights={weights!r} needs a checkpoint"
        )
    if isinstance(path, Path):
        misnamed = _misnamed(path, _content_format(path))
        if misnamed is not None:
            raise CheckpointError(f"{path}: cannot load: {misnamed}")
    if path.suffix == ".safetensors":
        return _read_safetensors(path)
    return _read_torch_file(path)


def _read_torch_file(path: Location) -> Weights:
    """A ``.pt`` file's state dict: the file's own, or under ``"model"`` or ``"state_dict"``."""
    loaded = load_file(path)
    if isinstance(loaded, Mapping):
        for key in ("model", "state_dict"):  # nanoGPT's ckpt.pt, Lightning's .ckpt
            if isinstance(loaded.get(key), Mapping):
                loaded = loaded[key]
                break
    if not isinstance(loaded, Mapping) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
        raise CheckpointError(f"{path}: not a state dict (a mapping of names to tensors)")
    return Weights(dict(loaded), path)


def _read_safetensors(path: Location) -> Weights:
    """A ``.safetensors`` file's weights; on object storage, from a downloaded copy."""
    if isinstance(path, UrlPath):
        with tempfile.TemporaryDirectory(prefix="trainloop-download-") as local:
            path.fs.get_file(path.path, f"{local}/{path.name}")
            return _from_safetensors(Path(local) / path.name, path)
    return _from_safetensors(path, path)


def _from_safetensors(local: Path, source: Location) -> Weights:
    """The weights of the ``.safetensors`` file ``local`` (a copy of ``source``, the file named)."""
    from safetensors import safe_open
    from safetensors.torch import load_file as load_safetensors

    try:
        with safe_open(str(local), framework="pt") as opened:
            metadata = opened.metadata() or {}
        state = load_safetensors(str(local))
    except Exception as error:  # safetensors raises its own SafetensorError, naming no file
        raise CheckpointError(f"{source}: cannot load: not a readable .safetensors file ({error})") from error
    step = metadata.get("step")
    return Weights(state, source, int(step) if step and step.isdigit() else None, None, metadata)


def _from_checkpoint(directory: Location, weights: str, verified: bool = False) -> Weights:
    # Every file verified against the manifest as it is read, once (unless it was, finding it).
    whole = read_checkpoint(directory, verify=not verified)
    metadata = read_metadata(directory)
    step, epoch = metadata.get("step"), metadata.get("epoch")
    rest = whole["training_state"]
    entries = {key: value for key, value in whole.items() if key != _REST}
    chosen = _choose(directory, weights, entries.__getitem__, sorted(entries))
    settings = rest.get("settings") if isinstance(rest, Mapping) else None
    return Weights(
        chosen, directory, step if isinstance(step, int) else None, settings,
        epoch=epoch if isinstance(epoch, int) else None,
    )


def _choose(directory: Location, weights: str, entry: Any, names: list[str]) -> dict[str, torch.Tensor]:
    """The state dict ``weights`` names among a checkpoint's top-level entries."""
    if weights == "model":
        if "model" not in names:
            raise CheckpointError(f"{directory} is not a complete checkpoint: it holds no model")
        return dict(entry("model"))
    candidates = [weights] if weights != "ema" else [n for n in names if n not in ("model",)]
    averaged = {}
    for name in candidates:
        state = entry(name) if name in names else None
        if isinstance(state, Mapping) and "n_averaged" in state:  # an AveragedModel's state dict
            averaged[name] = state
    if not averaged:
        what = "EMA weights" if weights == "ema" else f"averaged weights of a hook named {weights!r}"
        raise CheckpointError(
            f"{directory}: weights={weights!r}: this checkpoint holds no {what} "
            "(the run that saved it had no such EMA hook)"
        )
    if len(averaged) > 1:
        raise CheckpointError(
            f"{directory}: weights={weights!r}: more than one EMA hook's weights ({', '.join(sorted(averaged))}); "
            "name the hook whose weights to take"
        )
    (state,) = averaged.values()
    # AveragedModel keeps the model under "module." and counts its updates in "n_averaged".
    return {key.removeprefix("module."): value for key, value in state.items() if key != "n_averaged"}


def tied_keys(model: nn.Module) -> dict[str, str]:
    """Keys of ``model``'s state dict that share a tensor with an earlier key.

    For example GPT-2's ``lm_head.weight`` -> ``transformer.wte.weight``.
    """
    first: dict[int, str] = {}
    tied: dict[str, str] = {}
    for name, tensor in unwrap_model(model).state_dict(keep_vars=True).items():
        owner = first.setdefault(id(tensor), name)
        if owner != name:
            tied[name] = owner
    return tied


def _matches(key: str, patterns: Iterable[str]) -> bool:
    return any(key == p or (p.endswith(".") and key.startswith(p)) for p in patterns)


def _strip(key: str, prefixes: Iterable[str]) -> str:
    for prefix in prefixes:
        if key.startswith(prefix):
            return key[len(prefix):]
    return key


def _without_wrappers(keys: list[str], target: Mapping[str, Any]) -> list[str]:
    """``keys`` without the prefixes wrappers put before all of them (``_orig_mod.``, ``module.``).

    Prefixes that every key carries are removed, one after the other, as far as the keys fit the
    model's (``target``) best, and no further: a model whose own submodule is named ``module``
    keeps its keys; a DDP-wrapped one's lose one ``module.``.
    """
    best, fits = keys, sum(key in target for key in keys)
    while keys:
        prefix = next((p for p in _WRAPPER_PREFIXES if all(key.startswith(p) for key in keys)), None)
        if prefix is None:
            break
        keys = [key[len(prefix):] for key in keys]
        found = sum(key in target for key in keys)
        if found > fits:
            best, fits = keys, found
    return best


def load_weights(
    model: nn.Module,
    state_dict: Mapping[str, torch.Tensor],
    *,
    strict: bool = True,
    strip_prefixes: Iterable[str] = (),
    ignore: Iterable[str] = (),
    logger: logging.Logger | None = None,
    source: str = "init_from",
) -> list[str]:
    """Load ``state_dict`` into ``model`` (a plain, compiled, DDP- or FSDP-wrapped module).

    Keys are matched after removing ``strip_prefixes`` (and a wrapper's ``_orig_mod.`` /
    ``module.`` that every key carries, when the keys fit the model better without it); keys
    matching ``ignore`` are left out on both sides; a key the model ties to
    another (shared embeddings) is not missing when its twin is loaded.

    Args:
        model: The model to load into.
        state_dict: The weights.
        strict: Raise on missing or unexpected keys (else log them, one line each).
        strip_prefixes: Prefixes to remove from the source's keys (the first that matches).
        ignore: Keys, or key prefixes ending in ``.``, to leave out.
        logger: Where the lines about missing and unexpected keys go.
        source: What to name in the messages.

    Returns:
        The keys loaded.

    Raises:
        CheckpointError: A loaded key's shape differs from the model's (one line per key, both
            shapes), or, with ``strict``, keys are missing or unexpected (one line each).
    """
    ignore, prefixes = tuple(ignore), tuple(strip_prefixes)
    target = unwrap_model(model).state_dict()
    given = list(state_dict.items())
    keys = _without_wrappers([_strip(key, prefixes) for key, _ in given], target)
    source_state = {key: value for key, (_, value) in zip(keys, given, strict=True) if not _matches(key, ignore)}
    tied = tied_keys(model)
    expected = {key: value for key, value in target.items() if not _matches(key, ignore)}
    mismatched = [
        f"{source}: {key}: shape {tuple(source_state[key].shape)} in the source, {tuple(value.shape)} in the model"
        for key, value in expected.items()
        if key in source_state and source_state[key].shape != value.shape
    ]
    if mismatched:
        raise CheckpointError("\n".join(mismatched))
    missing = [k for k in expected if k not in source_state and not (k in tied and tied[k] in source_state)]
    unexpected = [k for k in source_state if k not in expected]
    lines = [f"{source}: missing key {k} (the model's own initialisation is kept)" for k in missing]
    lines += [f"{source}: unexpected key {k} (not in the model, not loaded)" for k in unexpected]
    if strict and lines:
        raise CheckpointError(
            "\n".join([*lines, f"{source}: set strict to false, or list keys in ignore or strip_prefixes"])
        )
    log = logger or logging.getLogger("trainloop")
    for line in lines:
        log.warning("%s", line)
    loading: dict[str, Any] = {k: v for k, v in source_state.items() if k in expected}
    # Through torch.distributed.checkpoint: it sees through compile/DDP and scatters full
    # tensors into an FSDP model's shards.
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    keys = sorted(loading)  # before the call, which adds the tied twins to the dict it is given
    set_model_state_dict(model, loading, options=StateDictOptions(full_state_dict=True, strict=False))
    return keys

