"""DeepSpeed's config as a run declares it: read (a mapping or a JSON file), checked against the settings, filled.

trainloop's settings own what both could say: the accumulation, the clipping, the precision and the micro batch
(the data loader's batch size). The config may repeat one of them only with the same value; a config that says
otherwise, or says it where trainloop's setting is unset, is refused in one line naming both (an unset
``grad_clip`` reaches DeepSpeed as ``gradient_clipping: 0``, or DeepSpeed would clip at 1.0 silently).
Nothing here imports DeepSpeed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "ZERO_STAGES", "config_problems", "filled_config", "micro_batch_problem", "offload_device", "read_config",
    "zero_stage",
]

#: The ZeRO stages DeepSpeed has.
ZERO_STAGES = (0, 1, 2, 3)

_PRECISIONS = ("bf16", "fp16")


def read_config(value: Mapping[str, Any] | str | Path) -> dict[str, Any]:
    """The config itself: ``value`` as a dict, or the JSON file it names read.

    Raises:
        ValueError: The file cannot be read, is not JSON, or holds something else than an object.
    """
    if isinstance(value, Mapping):
        return dict(value)
    path = Path(value)
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise ValueError(f"cannot read the DeepSpeed config {path}: {error.strerror or error}") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"the DeepSpeed config {path} is not JSON: {error}") from None
    if not isinstance(config, dict):
        raise ValueError(f"the DeepSpeed config {path} holds {type(config).__name__}, not an object")
    return config


def zero_stage(config: Mapping[str, Any]) -> int:
    """The config's ZeRO stage (0 when it declares none)."""
    stage = _section(config, "zero_optimization").get("stage", 0)
    return int(stage)


def offload_device(config: Mapping[str, Any]) -> str | None:
    """Where ``offload_optimizer`` keeps the optimizer states (``"cpu"``, ``"nvme"``); ``None``: on the device."""
    offload = _section(_section(config, "zero_optimization"), "offload_optimizer")
    device = offload.get("device")
    return device if device in ("cpu", "nvme") else None


def config_problems(
    config: Mapping[str, Any], *, accumulation: int, grad_clip: float | None, mixed_precision: str | None
) -> list[str]:
    """What in ``config`` contradicts trainloop's settings or cannot run, one line each naming both sides."""
    problems = []
    stage = _section(config, "zero_optimization").get("stage", 0)
    if type(stage) is not int or stage not in ZERO_STAGES:
        problems.append(f"deepspeed.zero_optimization.stage: {stage!r} is not a ZeRO stage (0, 1, 2 or 3)")
    given = config.get("gradient_accumulation_steps")
    if given is not None and given != accumulation:
        problems.append(
            f"deepspeed.gradient_accumulation_steps is {given!r} but gradient_accumulation_steps is {accumulation}: "
            "declare it once, in gradient_accumulation_steps"
        )
    clipping = config.get("gradient_clipping")
    if clipping is not None and clipping != (grad_clip or 0):
        ours = "unset (no clipping)" if grad_clip is None else repr(grad_clip)
        problems.append(
            f"deepspeed.gradient_clipping is {clipping!r} but grad_clip is {ours}: declare it once, in grad_clip"
        )
    for precision in _PRECISIONS:
        enabled = _section(config, precision).get("enabled")
        if enabled is None or enabled == "auto":
            continue
        if bool(enabled) != (mixed_precision == precision):
            ours = "unset" if mixed_precision is None else repr(mixed_precision)
            problems.append(
                f"deepspeed.{precision}.enabled is {enabled!r} but mixed_precision is {ours}: "
                "declare the precision once, in mixed_precision"
            )
    return problems


def micro_batch_problem(config: Mapping[str, Any], batch_size: int | None, accumulation: int, ranks: int) -> str | None:
    """What the config's batch sizes say against the data loader's ``batch_size`` (the micro batch), if anything."""
    given = config.get("train_micro_batch_size_per_gpu")
    if given is not None and given != "auto" and batch_size is not None and given != batch_size:
        return (
            f"deepspeed.train_micro_batch_size_per_gpu is {given!r} but the data loader's batch size is "
            f"{batch_size}: leave it out (trainloop fills it from the data loader)"
        )
    total = config.get("train_batch_size")
    if total is not None and total != "auto" and batch_size is not None and total != batch_size * accumulation * ranks:
        return (
            f"deepspeed.train_batch_size is {total!r} but the data loader's batch size {batch_size} x "
            f"gradient_accumulation_steps {accumulation} x {ranks} rank(s) is {batch_size * accumulation * ranks}: "
            "leave it out (DeepSpeed derives it)"
        )
    return None


def filled_config(
    config: Mapping[str, Any],
    *,
    accumulation: int,
    grad_clip: float | None,
    mixed_precision: str | None,
    batch_size: int | None,
) -> dict[str, Any]:
    """``config`` with what trainloop's settings own filled in (checked with ``config_problems`` first)."""
    filled = dict(config)
    filled["gradient_accumulation_steps"] = accumulation
    filled["gradient_clipping"] = grad_clip or 0.0
    for precision in _PRECISIONS:
        filled[precision] = {**_section(config, precision), "enabled": mixed_precision == precision}
    if batch_size is not None:
        filled["train_micro_batch_size_per_gpu"] = batch_size
    return filled


def _section(config: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    section = config.get(name)
    return section if isinstance(section, Mapping) else {}
