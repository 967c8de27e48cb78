"""What a run's kind changes in the loop: a training run, or a run that trains nothing (evaluate, predict).

A run that trains nothing is another path through the same machine: ``building -> restoring ->
validating -> exiting`` for ``evaluate``, ``building -> restoring -> predicting -> exiting`` for
predict (``trainloop.predict.run`` does that run's work). Of the hooks it builds, only the
validations take part; ``restoring`` loads the model's weights alone, from a ``WeightsSource``
(see ``trainloop.evaluation``); and it is a run, recorded in ``runs.jsonl``, only once its
weights are restored: one refused before (no validation to run, no checkpoint) is not.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from trainloop.evaluation import WeightsSource, check_validations
from trainloop.machine.table import State

if TYPE_CHECKING:
    from trainloop.hooks.base import BaseHook
    from trainloop.predict.run import PredictRun
    from trainloop.result import RunKind

__all__ = ["RunOfKind", "Work"]

Work = dict[State, Callable[[], None]]
"""Each state's work in a run."""


class RunOfKind:
    """One run of a kind: the hooks that take part, each state's work, and whether the run is recorded.

    Args:
        kind: ``"train"``, ``"evaluate"`` or ``"predict"``.
        source: Where a run that trains nothing takes the model's weights from.
        predict_run: A predict run's work (``trainer.predict()`` makes it).

    Attributes:
        built_hooks: Every hook the run built, also those a run that trains nothing leaves out
            (a ``CheckpointingHook`` still says where the checkpoints are).
        recorded: Whether the run is recorded however it ends: a training run always, a run that
            trains nothing once its weights are restored.
    """

    def __init__(
        self, kind: RunKind = "train", source: WeightsSource | None = None, predict_run: PredictRun | None = None
    ) -> None:
        self.kind = kind
        self.source = source if source is not None else WeightsSource()
        self.predict_run = predict_run
        self.built_hooks: tuple[BaseHook, ...] = ()
        self.recorded = kind == "train"

    def work(self, training: Work, restore_weights: Callable[[], None]) -> Work:
        """Each state's work in a run of this kind.

        Args:
            training: Each state's work in a training run.
            restore_weights: The work of ``restoring`` in an evaluate run (the weights alone).
        """
        if self.kind == "train":
            return training
        if self.kind == "predict":
            work = self.predict_run.work()  # type: ignore[union-attr]  # trainer.predict() made it
        else:
            work = {**training, State.RESTORING: restore_weights}
        restore = work[State.RESTORING]

        def restored() -> None:
            restore()
            self.recorded = True  # from here on it is a run, recorded even if it fails

        work[State.RESTORING] = restored
        return work

    def taking_part(self, hooks: Sequence[BaseHook], owner: str) -> list[BaseHook]:
        """The hooks that take part: all of them in training, else the validations alone.

        No other hook loads, saves or watches a run that trains nothing.

        Args:
            hooks: The hooks the run built, in order.
            owner: Where they come from (the trainer class), for the message.

        Raises:
            trainloop.evaluation.EvaluateError: An evaluate run and no hook validates.
        """
        if self.kind == "train":
            return list(hooks)
        self.built_hooks = tuple(hooks)
        validations = [h for h in hooks if h.schedule is not None and h.schedule.state == "validating"]
        if self.kind == "evaluate":
            check_validations(validations, owner)
        return validations
