"""``LoggingHook``: send aggregated training statistics to ``trainer.log``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from trainloop.hook_machinery.registry import register_hook
from trainloop.hooks.stats import StatsHook, TrainingStats

if TYPE_CHECKING:
    from trainloop.core.run_state import TrainerView
    from trainloop.hook_machinery.base import BaseHook
    from trainloop.settings.model import TrainerSettings

__all__ = ["DEFAULT_LOG_INTERVAL", "LoggingHook"]

#: Steps per record of the loss and LR in ``metrics.jsonl`` when no ``LoggingHook`` is declared.
DEFAULT_LOG_INTERVAL = 10


@register_hook("logging")
class LoggingHook(StatsHook):
    """Call ``trainer.log(records)`` with the training statistics every ``interval`` steps.

    The records are :meth:`TrainingStats.to_records
    <trainloop.hooks.stats.TrainingStats.to_records>` of the aggregate over the steps since
    the previous call (see ``StatsHook``)::

        {"loss": 0.52, "grad_norm": 2.3, "lr": {"group_0": 1e-3}, "step_time": 0.25,
         "data_time": 0.01, "non_finite_grad_retries": 0, "records": {...forward's...}}

    Every rank calls ``trainer.log``; the hooks that write records decide which rank writes.
    Put this hook before those hooks: a run that ends early is flushed in ``exiting``,
    which must reach them before they close.

    Args:
        interval: Log at every multiple of this many steps, and at the last step.
        sync: Average across ranks when a ``torch.distributed`` process group is initialised
            (a collective at each logging step: every rank must run this hook).

    Raises:
        pydantic.ValidationError: A parameter is invalid; the error names it.
    """

    @classmethod
    def default_hook(cls, settings: TrainerSettings, hooks: Sequence[BaseHook]) -> LoggingHook | None:
        """``LoggingHook(interval=DEFAULT_LOG_INTERVAL)`` for a run that keeps a ``metrics.jsonl``, which nothing logs.

        Added when the run has a workspace with ``metrics_file`` on and no hook already logs the training
        statistics: a run with a workspace records its loss and learning rate without asking.
        """
        if settings.workspace is None or not settings.metrics_file or any(isinstance(h, LoggingHook) for h in hooks):
            return None
        return cls(interval=DEFAULT_LOG_INTERVAL)

    def emit(self, trainer: TrainerView, stats: TrainingStats) -> None:
        """Pass the statistics to ``trainer.log``."""
        trainer.log(stats.to_records())
