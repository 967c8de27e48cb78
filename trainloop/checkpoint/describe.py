"""What a checkpoint holds, for people: ``trainloop inspect`` prints it.

``describe_checkpoint`` verifies a checkpoint directory against its manifest, loads it and
summarises it as JSON data; ``format_checkpoint`` writes that summary as aligned text lines.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import torch

from trainloop.checkpoint.errors import CheckpointError
from trainloop.checkpoint.files import checkpoint_format, read_checkpoint
from trainloop.checkpoint.manifest import read_manifest, read_metadata
from trainloop.location import Location, location
from trainloop.settings.optimizer import OPTIMIZERS

__all__ = ["describe_checkpoint", "format_checkpoint", "jsonable"]


def _tensors(value: Any) -> Iterable[Any]:
    """The tensors nested anywhere in ``value`` (dicts, lists, tuples)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _tensor_stats(value: Any) -> dict[str, Any]:
    tensors = list(_tensors(value))
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in tensors})
    return {
        "tensors": len(tensors),
        "elements": sum(t.numel() for t in tensors),
        "bytes": sum(t.numel() * t.element_size() for t in tensors),
        "dtypes": dtypes,
    }


# Keys torch or trainloop add to a param group beyond the optimizer's own defaults.
_GROUP_EXTRAS = frozenset({"params", "initial_lr", "name"})


def _infer_optimizer(groups: list[dict[str, Any]]) -> str | None:
    """The ``torch.optim`` class whose param-group keys match the saved groups', if one does."""
    if not groups or not isinstance(groups[0], dict):
        return None
    keys = set(groups[0]) - _GROUP_EXTRAS
    matches = []
    probe = torch.zeros(2, 2, requires_grad=True)  # 2-D: Muon takes nothing else
    for name, cls in OPTIMIZERS.items():
        try:
            defaults = cls([probe]).defaults  # type: ignore[call-arg]
        except Exception:  # noqa: BLE001, S112 - one that needs more arguments cannot be matched
            continue
        if set(defaults) == keys:
            matches.append((name, defaults))
    if len(matches) > 1 and "decoupled_weight_decay" in keys:
        # Adam and AdamW share their keys; the flag tells them apart.
        matches = [(n, d) for n, d in matches if d.get("decoupled_weight_decay") == groups[0]["decoupled_weight_decay"]]
    return " or ".join(name for name, _ in matches) or None


def describe_checkpoint(directory: Location | str) -> dict[str, Any]:
    """What a checkpoint holds, as plain data (what ``trainloop inspect --json`` prints).

    The files are checked against the checkpoint's manifest first, then read with
    ``weights_only=True`` (nothing in them can run code).

    Args:
        directory: One checkpoint directory (``<checkpoints>/<step>``), local or a URL.

    Raises:
        trainloop.checkpoint.CheckpointError: The checkpoint is incomplete or corrupt; the
            message names the file.
        CheckpointError: The files do not load, or load but are not a trainloop checkpoint.
    """
    directory = location(directory)
    manifest = read_manifest(directory)
    state = read_checkpoint(directory)  # verified as it is read: each file read once
    try:
        metadata: dict[str, Any] | None = read_metadata(directory)
    except CheckpointError:  # optional: the state itself says the step
        metadata = None
    training = state.get("training_state")
    if not isinstance(training, dict) or "step" not in training:
        raise CheckpointError(f"{directory / 'training_state.pt'}: not a trainloop training state (no 'step')")
    if not isinstance(state.get("model"), dict):
        raise CheckpointError(f"{directory}: its model state is not a state dict")

    settings: Any = None
    if training.get("settings") is not None:
        try:
            settings = json.loads(training["settings"])
        except (TypeError, ValueError) as error:
            raise CheckpointError(f"{directory / 'training_state.pt'}: its settings are not JSON ({error})") from None

    declared = settings.get("optimizer") if isinstance(settings, dict) else None
    optimizer = _optimizer_info(training.get("optimizer"), declared)
    named = training.get("optimizers")
    if isinstance(named, dict):  # several optimizers, by name
        declared_by_name = (settings or {}).get("optimizers") or {} if isinstance(settings, dict) else {}
        optimizer = {
            "by_name": {name: _optimizer_info(state, declared_by_name.get(name)) for name, state in named.items()}
        }

    scheduler = training.get("lr_scheduler")
    scaler = training.get("grad_scaler")
    rng, loaders = training.get("rng"), training.get("data_loader")
    hooks = {key: _tensor_stats(value) | {"keys": sorted(map(str, value)) if isinstance(value, dict) else []}
             for key, value in state.items() if key not in ("model", "training_state")}
    return {
        "checkpoint": str(directory),
        "step": training["step"],
        "epoch": training.get("epoch"),
        "format": checkpoint_format(directory),
        "files": {rel: digest.size for rel, digest in sorted(manifest.items())},
        "metadata": metadata,
        "model": _tensor_stats(state["model"]),
        "optimizer": optimizer,
        "lr_scheduler": {"by_name": {name: _scheduler_info(s) for name, s in scheduler.items()}}
        if isinstance(named, dict) and isinstance(scheduler, dict)
        else _scheduler_info(scheduler),
        "grad_scaler": {
            "enabled": bool(scaler),
            **({"scale": float(scaler["scale"])} if scaler and "scale" in scaler else {}),
        },
        "rng": None
        if rng is None
        else {"ranks": len(rng), "generators": sorted(rng[0]) if rng and isinstance(rng[0], dict) else []},
        "data_loader": None if loaders is None or all(item is None for item in loaders) else {"ranks": len(loaders)},
        "hooks": hooks,
        "settings": settings,
    }



def _scheduler_info(scheduler: Any) -> dict[str, Any] | None:
    """What a saved lr scheduler says: its last epoch and learning rates."""
    if not isinstance(scheduler, dict):
        return None
    return {"last_epoch": scheduler.get("last_epoch"), "last_lr": scheduler.get("_last_lr")}


def _optimizer_info(optimizer_state: Any, declared: Any) -> dict[str, Any] | None:
    """What one optimizer's saved state says: its class (inferred or declared), param groups, state sizes."""
    if not isinstance(optimizer_state, dict):
        return None
    groups = optimizer_state.get("param_groups") or []
    declared_name = declared.get("name") if isinstance(declared, dict) else None
    # The param groups tell what was built; the settings only what was declared, which a
    # trainer's own build_optimizer() may ignore.
    inferred = _infer_optimizer(groups)
    return {
        "class": inferred or declared_name,
        "class_from": "param groups" if inferred else "settings" if declared_name else None,
        "declared": declared_name,
        "param_groups": [
            {k: v for k, v in group.items() if k in ("name", "lr", "weight_decay")}
            | {"params": len(group.get("params", ()))}
            for group in groups
            if isinstance(group, dict)
        ],
        "params_with_state": len(optimizer_state.get("state") or {}),
        **_tensor_stats(optimizer_state.get("state")),
    }

def jsonable(value: Any) -> Any:
    """``value`` as JSON can hold it: a tensor as a list, anything else as text."""
    # A tensor lr (capturable optimizers) or scheduler value; anything else, as text.
    return value.tolist() if isinstance(value, torch.Tensor) else str(value)


def _size(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024  # type: ignore[assignment]
    raise AssertionError("unreachable")


def _tensors_text(stats: dict[str, Any]) -> str:
    dtypes = f", {'/'.join(stats['dtypes'])}" if stats["dtypes"] else ""
    return f"{stats['tensors']} tensors, {stats['elements']:,} elements, {_size(stats['bytes'])}{dtypes}"


def format_checkpoint(info: dict[str, Any], root: Location | None) -> str:
    """The human-readable report of ``describe_checkpoint``."""
    lines = [f"checkpoint:   {info['checkpoint']}" + (f"  (latest of {root})" if root is not None else "")]
    lines.append(f"step:         {info['step']}" + (f"  (epoch {info['epoch']})" if info["epoch"] is not None else ""))
    metadata = info["metadata"] or {}
    made = [f"{info['format']} format"] + [
        f"{name} {metadata[key]}"
        for key, name in (("trainloop_version", "trainloop"), ("torch_version", "torch"))
        if key in metadata
    ]
    lines.append(f"saved:        {metadata.get('time', 'at an unknown time')} ({', '.join(made)})")
    files = info["files"]
    listed = (
        ", ".join(f"{rel} ({_size(size)})" for rel, size in files.items()) if len(files) <= 6 else f"{len(files)} files"
    )
    lines.append(f"files:        {listed}; {_size(sum(files.values()))} in all, matching its manifest")
    if metadata.get("metrics"):
        lines.append(
            "metrics:      "
            + ", ".join(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}" for k, v in metadata["metrics"].items())
        )
    lines.append(f"model:        {_tensors_text(info['model'])}")
    lines += _optimizers_lines(info, metadata)
    scheduler = info["lr_scheduler"]
    if scheduler is not None and "by_name" in scheduler:
        described = ", ".join(f"{name} {_scheduler_text(s)}" for name, s in scheduler["by_name"].items())
        lines.append(f"lr scheduler: {described or 'none'}")
    else:
        lines.append(f"lr scheduler: {_scheduler_text(scheduler)}")
    scaler = info["grad_scaler"]
    if not scaler["enabled"]:
        lines.append("grad scaler:  disabled")
    else:
        lines.append("grad scaler:  " + (f"enabled (scale={scaler['scale']:g})" if "scale" in scaler else "enabled"))
    rng = info["rng"]
    lines.append(
        "rng state:    "
        + ("not saved" if rng is None else f"saved for {rng['ranks']} rank(s): {', '.join(rng['generators'])}")
    )
    loader = info["data_loader"]
    saved = (
        f"position saved for {loader['ranks']} rank(s)"
        if loader is not None
        else "no position saved (not a stateful loader)"
    )
    lines.append("data loader:  " + saved)
    if info["hooks"]:
        for key, stats in info["hooks"].items():
            keys = f" [{', '.join(stats['keys'])}]" if stats["keys"] else ""
            lines.append(f"hook state:   {key}{keys}: {_tensors_text(stats)}")
    else:
        lines.append("hook state:   none")
    if info["settings"] is None:
        lines.append("settings:     not saved")
    else:
        lines.append("settings:")
        lines += ["  " + line for line in json.dumps(info["settings"], indent=2).splitlines()]
    return "\n".join(lines) + "\n"


def _optimizers_lines(info: dict[str, Any], metadata: dict[str, Any]) -> list[str]:
    """The optimizers a checkpoint holds in words; under DeepSpeed, where its engine keeps them (not read here)."""
    optimizer = info["optimizer"]
    if info["format"] == "deepspeed":  # each rank's partition, in the engine's files
        layout = metadata.get("deepspeed")
        held = f" (ZeRO stage {layout['zero_stage']}, {layout['precision']})" if isinstance(layout, dict) else ""
        return [f"optimizer:    in DeepSpeed's engine files{held}, under deepspeed/engine"]
    if optimizer is None:
        return ["optimizer:    none saved"]
    if "by_name" in optimizer:
        by_name = optimizer["by_name"].items()
        return [line for name, one in by_name for line in _optimizer_lines(f"optimizer {name}:", one)]
    return _optimizer_lines("optimizer:   ", optimizer)


def _optimizer_lines(head: str, optimizer: dict[str, Any] | None) -> list[str]:
    """One optimizer in words: its class, param groups and state."""
    if optimizer is None:
        return [f"{head} none saved"]
    name = f"{optimizer['class']} (from its {optimizer['class_from']})" if optimizer["class"] else "unknown class"
    if optimizer["declared"] and optimizer["class"] and optimizer["declared"] not in optimizer["class"].split(" or "):
        name += f", although the settings declare {optimizer['declared']}"
    groups = "; ".join(", ".join(f"{k}={v}" for k, v in group.items()) for group in optimizer["param_groups"])
    return [
        f"{head} {name}, {len(optimizer['param_groups'])} param group(s): {groups}",
        f"              state for {optimizer['params_with_state']} params: {_tensors_text(optimizer)}",
    ]


def _scheduler_text(scheduler: dict[str, Any] | None) -> str:
    if scheduler is None:
        return "none"
    return f"yes (last_epoch={scheduler['last_epoch']}, last lr={scheduler['last_lr']})"
