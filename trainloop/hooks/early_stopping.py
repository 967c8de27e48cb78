"""``EarlyStoppingHook``: end the run cleanly once a logged metric stops improving."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import Field, validate_call

from trainloop.hook_machinery.base import BaseHook
from trainloop.hook_machinery.registry import register_hook
from trainloop.settings.types import NonNegativeFloat, PositiveInt
from trainloop.utils import flatten_nested_dict, hint_for_missing_key, to_float, warn_user

if TYPE_CHECKING:
    from trainloop.core.run_state import TrainerView

__all__ = ["EarlyStoppingHook", "MonitorNotFoundWarning"]


class MonitorNotFoundWarning(UserWarning):
    """The metric an ``EarlyStoppingHook`` monitors never appeared in the logged records."""


@register_hook("early_stopping")
class EarlyStoppingHook(BaseHook):
    """Ask the run to end cleanly when a logged metric has stopped improving.

    The hook reads the records given to ``trainer.log`` (for example by a
    ``ValidationHook``, which logs under ``"val"``), flattened
    with ``/``: ``{"val": {"loss": 0.3}}`` is ``"val/loss"``. Each time ``monitor`` appears is
    one observation. An observation improves when it beats the best so far by more than
    ``min_delta``; after ``patience`` observations in a row without improvement the hook calls
    ``trainer.request_exit()``, so the run ends after the current step (with a final checkpoint
    if a hook made a standing ``request_checkpoint(at_exit=True)``). A NaN never improves.

    The best value and the count of observations without improvement are saved in checkpoints
    under the hook's ``name``, so a resumed run keeps counting.

    Args:
        monitor: The flattened key of the metric, e.g. ``"val/loss"``.
        mode: ``"min"`` if lower is better, ``"max"`` if higher is better.
        patience: How many observations in a row without improvement end the run.
        min_delta: The margin by which a value must beat the best to count as an improvement.

    Attributes:
        best: The best value observed, or ``None`` before the first (finite) one.
        bad_count: Observations in a row without improvement.
        observations: How many times the metric was observed (resumed runs included).
        stopped_step: The step at which the hook requested exit, or ``None``.
    """

    @validate_call
    def __init__(
        self,
        monitor: Annotated[str, Field(min_length=1)],
        mode: Literal["min", "max"] = "min",
        patience: PositiveInt = 3,
        min_delta: NonNegativeFloat = 0.0,
    ) -> None:
        self.monitor = monitor
        self.mode = mode
        self.patience = patience
        self.min_delta = min_delta
        self.best: float | None = None
        self.bad_count = 0
        self.observations = 0
        self.stopped_step: int | None = None
        # Keys logged while the metric has not been seen, to suggest a fix for a typo.
        self._keys_seen: set[str] = set()

    def on_log(self, trainer: TrainerView, records: dict[str, Any]) -> None:
        """Observe ``monitor`` if these records hold it; request exit when patience runs out."""
        flat = flatten_nested_dict(records)
        if self.monitor not in flat:
            if self.observations == 0 and len(self._keys_seen) < 1000:
                self._keys_seen.update(flat)
            return
        self._observe(trainer, to_float(flat[self.monitor], self.monitor))

    def _observe(self, trainer: TrainerView, value: float) -> None:
        self.observations += 1
        if self._improves(value):
            self.best = value
            self.bad_count = 0
            return
        self.bad_count += 1
        if self.bad_count >= self.patience:
            trainer.logger.info(
                "Early stopping at step %d: %s has not improved on %s for %d observations",
                trainer.step, self.monitor, self.best, self.bad_count,
            )
            self.stopped_step = trainer.step
            trainer.request_exit()

    def _improves(self, value: float) -> bool:
        if math.isnan(value):
            return False
        if self.best is None:
            return True
        if self.mode == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta

    def on_after_train(self, trainer: TrainerView) -> None:
        """Warn if the monitored metric never appeared (a typo in ``monitor``, most often)."""
        # A run that failed may simply not have reached its first evaluation.
        if self.observations or trainer.error is not None:
            return
        hint = hint_for_missing_key(self.monitor, self._keys_seen)
        warn_user(
            f"{type(self).__name__}: the monitored key {self.monitor!r} never appeared in the "
            f"logged records, so early stopping never acted{hint}",
            MonitorNotFoundWarning,
        )

    def on_state_dict(self, trainer: TrainerView, state_dict: dict[str, Any]) -> None:
        """Save the best value and the count without improvement under ``self.name``."""
        state_dict[self.name] = {
            "monitor": self.monitor,
            "mode": self.mode,
            "best": self.best,
            "bad_count": self.bad_count,
            "observations": self.observations,
        }

    def on_load_state_dict(self, trainer: TrainerView, state_dict: dict[str, Any]) -> None:
        """Restore the state saved by ``on_state_dict``.

        A checkpoint without this hook's state, or one that monitored another metric or mode,
        leaves the hook starting afresh (with a warning in the trainer's log).
        """
        state = state_dict.get(self.name)
        if state is None:
            trainer.logger.warning(
                "%s %r: the checkpoint holds no early-stopping state; starting afresh",
                type(self).__name__, self.name,
            )
            return
        if (state["monitor"], state["mode"]) != (self.monitor, self.mode):
            # A best value of another metric (or direction) would be meaningless here.
            trainer.logger.warning(
                "%s %r: the checkpoint monitored %r (%s), this hook monitors %r (%s); "
                "starting afresh",
                type(self).__name__, self.name, state["monitor"], state["mode"],
                self.monitor, self.mode,
            )
            return
        self.best = None if state["best"] is None else float(state["best"])
        self.bad_count = int(state["bad_count"])
        self.observations = int(state["observations"])

