"""A model's weights alone: read from a checkpoint or a state-dict file, and loaded into a model.

``init_from`` (see :class:`~trainloop.settings.init_from.InitFromSettings`) starts a run from
them; ``trainloop export`` (:mod:`trainloop.checkpoint.export`) writes them out. Sources:

- a trainloop checkpoint directory, full or sharded (a checkpoints root or a workspace: its
  latest), whose model or EMA weights are taken;
- a ``.safetensors`` file;
- a ``.pt`` / ``.pth`` / ``.bin`` file holding a state dict (read with ``weights_only=True``),
  or a dict with the state dict under ``"model"`` or ``"state_dict"`` (nanoGPT's ``ckpt.pt``).

Each may be local or on object storage (a URL: see :mod:`trainloop.checkpoint.storage`).
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from trainloop.checkpoint import storage
from trainloop.checkpoint.errors import CheckpointError
from trainloop.checkpoint.files import LATEST, checkpoint_format, latest_checkpoint, read_checkpoint
from trainloop.checkpoint.loading import load_file
from trainloop.checkpoint.manifest import read_metadata
from trainloop.checkpoint.storage import MANIFEST, Location, UrlPath, location
from trainloop.utils import unwrap_model

if TYPE_CHECKING:
    from trainloop.core.run_state import TrainerView
    from trainloop.settings.init_from import InitFromSettings

__all__ = ["Weights", "find_checkpoint", "init_from", "load_weights", "read_weights", "tied_keys", "weights_problem"]

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
        settings_json: The settings of the run that saved the checkpoint, if known.
        metadata: String metadata of a ``.safetensors`` file.
    """

    state_dict: dict[str, torch.Tensor]
    source: Location
    step: int | None = None
    settings_json: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)


def find_checkpoint(path: Location) -> Location:
    """The checkpoint directory ``path`` names.

    Itself, or a checkpoints root's (or a workspace's ``checkpoints/``) latest complete checkpoint.

    Raises:
        CheckpointError: Nothing there is a checkpoint; the message names ``path``.
    """
    if storage.is_file(path / MANIFEST):
        return path
    for root in (path, path / "checkpoints"):
        if any(name == LATEST or name.isdigit() for name in storage.names(root)):
            found = latest_checkpoint(root)
            if found is not None:
                return found
    raise CheckpointError(
        f"{path}: not a checkpoint directory, nor a checkpoints root or workspace with a complete checkpoint"
    )


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
    if checkpoint_format(directory) == "sharded":
        return None
    stems = (name.removesuffix(".pt") for name in storage.names(directory) if name.endswith(".pt"))
    entries = sorted(stem for stem in stems if stem not in ("model", _REST))
    if (weights == "ema" and entries) or weights in entries:
        return None
    listed = ", ".join(entries) or "none"
    return f"weights={weights!r}, but {str(directory)!r} holds no such averaged weights (its hook entries: {listed})"


def read_weights(path: str | Location, weights: str = "model") -> Weights:
    """Read a model's weights from a checkpoint (verified against its manifest) or a file.

    Args:
        path: A checkpoint directory, checkpoints root or workspace; or a ``.safetensors`` or
            ``.pt`` file; local, or a URL (its filesystem configured by fsspec's configuration,
            or a :class:`~trainloop.checkpoint.storage.UrlPath` made with its options).
        weights: From a checkpoint: ``"model"``, ``"ema"`` (the one EMA hook's averaged
            weights) or the name of the hook whose averaged weights to take.

    Raises:
        CheckpointError: The path is missing, corrupt, or holds no such weights.
    """
    path = location(path)
    if not storage.exists(path):
        raise CheckpointError(f"{path}: no such file or directory")
    if storage.is_dir(path):
        return _from_checkpoint(find_checkpoint(path), weights)
    if weights != "model":
        raise CheckpointError(
            f"{path}: a weights file holds one model's weights; weights={weights!r} needs a checkpoint"
        )
    if path.suffix == ".safetensors":
        if isinstance(path, UrlPath):
            with tempfile.TemporaryDirectory(prefix="trainloop-download-") as local:
                path.fs.get_file(path.path, f"{local}/{path.name}")
                found = _from_safetensors(Path(local) / path.name, path)
            return found
        return _from_safetensors(path, path)
    loaded = load_file(path)
    if isinstance(loaded, Mapping):
        for key in ("model", "state_dict"):  # nanoGPT's ckpt.pt, Lightning's .ckpt
            if isinstance(loaded.get(key), Mapping):
                loaded = loaded[key]
                break
    if not isinstance(loaded, Mapping) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
        raise CheckpointError(f"{path}: not a state dict (a mapping of names to tensors)")
    return Weights(dict(loaded), path)


def _from_safetensors(local: Path, source: Location) -> Weights:
    """The weights of the ``.safetensors`` file ``local`` (a copy of ``source``, the file named)."""
    from safetensors import safe_open
    from safetensors.torch import load_file as load_safetensors

    with safe_open(str(local), framework="pt") as opened:
        metadata = opened.metadata() or {}
    try:
        state = load_safetensors(str(local))
    except Exception as error:  # safetensors raises its own SafetensorError
        raise CheckpointError(f"{source}: cannot load: {error}") from error
    step = metadata.get("step")
    return Weights(state, source, int(step) if step and step.isdigit() else None, None, metadata)


def _from_checkpoint(directory: Location, weights: str) -> Weights:
    whole = read_checkpoint(directory)  # every file verified against the manifest as it is read, once
    step = read_metadata(directory).get("step")
    rest = whole["training_state"]
    entries = {key: value for key, value in whole.items() if key != _REST}
    chosen = _choose(directory, weights, entries.__getitem__, sorted(entries))
    settings = rest.get("settings") if isinstance(rest, Mapping) else None
    return Weights(chosen, directory, step if isinstance(step, int) else None, settings)


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

    Keys are matched after removing ``strip_prefixes`` (and the wrappers' own ``_orig_mod.`` /
    ``module.``); keys matching ``ignore`` are left out on both sides; a key the model ties to
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
    ignore = tuple(ignore)
    prefixes = (*strip_prefixes, *_WRAPPER_PREFIXES)
    source_state: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        clean = _strip(_strip(key, prefixes), _WRAPPER_PREFIXES)
        if not _matches(clean, ignore):
            source_state[clean] = value
    target = unwrap_model(model).state_dict()
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


def init_from(trainer: TrainerView) -> None:
    """Load ``settings.init_from``'s weights into a trainer that resumed no checkpoint.

    Called in ``restoring``, after the checkpoint hooks' load and before ``on_before_train``
    (so an EMA hook averages from the loaded weights). A run at step 0 has resumed nothing
    that trained: even a checkpoint saved at step 0 holds the weights ``init_from`` gives.
    """
    spec: InitFromSettings | None = trainer.settings.init_from
    if spec is None:
        return
    if trainer.step > 0:
        trainer.logger.info(
            "init_from %s not loaded: the run resumed its own checkpoint at step %d", spec.path, trainer.step
        )
        return
    found = read_weights(location(spec.path, spec.storage_options), spec.weights)
    loaded = load_weights(
        trainer.model, found.state_dict, strict=spec.strict, strip_prefixes=spec.strip_prefixes,
        ignore=spec.ignore, logger=trainer.logger,
    )
    at = f" (step {found.step})" if found.step is not None else ""
    trainer.logger.info("Initialised %d weights of the model from %s%s", len(loaded), found.source, at)
