"""``RunResult``: what ``train()`` returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .trainer import BaseTrainer

__all__ = ["RunResult", "run_result"]


@dataclass(frozen=True)
class RunResult:
    """The outcome of a run, as ``train()`` returns it (also kept as ``trainer.result``).

    Attributes:
        step: The last step run (or resumed at, when nothing was left to run).
        epoch: Full passes over the data completed.
        exit_code: ``0``, or the code an exit signal asked for (``train()`` then raises
            ``SystemExit`` with it; read the result from ``trainer.result``).
        metrics: The last value of every key logged through ``trainer.log`` in this run,
            flattened (``"val/loss"``), as Python floats.
        best_checkpoint: The best checkpoint by a ``CheckpointingHook``'s ``monitor`` (with
            ``keep_best``), else ``None``.
        history: Every ``trainer.log`` call of this run as a flat record with ``step`` and
            ``time`` (the workspace's ``metrics.jsonl`` holds the resumed runs' too).
    """

    step: int
    epoch: int
    exit_code: int
    metrics: dict[str, float]
    best_checkpoint: Path | None = None
    history: list[dict[str, Any]] = field(default_factory=list, repr=False)


def run_result(trainer: BaseTrainer) -> RunResult:
    """The result of ``trainer``'s run, read once it has exited."""
    best = None
    for hook in trainer.hooks:
        found = getattr(hook, "best_checkpoint", None)
        if isinstance(found, Path):
            best = found
            break
    return RunResult(
        step=trainer.step,
        epoch=trainer.run_length.epochs_completed,
        exit_code=trainer.exit_code or 0,
        metrics=dict(trainer.metrics.last),
        best_checkpoint=best,
        history=list(trainer.metrics.history),
    )
