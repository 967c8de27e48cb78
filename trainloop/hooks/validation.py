"""``ValidationHook``: evaluate the model every N steps, in eval mode, and log the results."""

from __future__ import annotations

import difflib
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Annotated, Any, Literal, cast

import torch
from pydantic import Field, validate_call
from pydantic.json_schema import SkipJsonSchema

from trainloop.hook_machinery.base import BaseHook
from trainloop.hook_machinery.checks import HookProblem
from trainloop.hook_machinery.registry import register_hook
from trainloop.hook_machinery.schedule import Schedule
from trainloop.settings.types import PositiveInt, StrictBool
from trainloop.utils import Records, flatten_nested_dict, module_modes_kept

if TYPE_CHECKING:
    from trainloop.core.run_state import TrainerView

__all__ = ["ValidationHook"]

#: A trainer method's name, as a settings file declares it.
MethodName = Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]

_MISSING = object()
#: The trainer's own runs: a validation method by one of these names would call a run inside a run.
_RUNS = ("train", "evaluate", "predict")
_RENAME = "name your validation method otherwise (e.g. val_metrics) and point evaluate at it"


@register_hook("validation")
class ValidationHook(BaseHook):
    """Run an evaluation every ``interval`` steps (or epochs) and log what it returns under ``prefix``.

    Evaluations follow the hook's ``schedule``, the ``every(n)`` rule (``trainloop.hooks.Schedule``),
    and each runs in the machine's ``validating`` state, so its time is its own in traces and
    reports: after every ``interval``-th step (or epoch), once at the start of the run when
    ``at_start`` (after ``restoring``, before the first step), and after the last step of a run
    that ends cleanly (``at_last_step``: ``max_steps`` or ``max_epochs`` reached, or an exit
    request without an exit code, such as ``EarlyStoppingHook``'s). From ``validating`` the
    machine goes on to ``checkpointing`` (so a keep-best checkpoint is judged on the fresh
    metric), to ``exiting``, or to the next step. Several validation hooks may be due at once:
    they run in hook order, in one visit.

    After an exit signal (a ``CheckpointingHook``'s SIGTERM/SIGUSR1/SIGINT, which requests an exit
    with an exit code) the run saves and exits without validating, also when a validation was
    due at that step: the grace period a scheduler gives before SIGKILL is for the save.
    ``on_exit_signal="validate"`` validates first.

    The evaluation runs with the model in eval mode, under ``torch.no_grad()`` and the trainer's
    autocast (``settings.mixed_precision`` on ``trainer.device``). What it draws from the random
    generators (a loader's base seed, a sampled metric) stays off the training's stream: the
    ``validating`` state gives them back their states, so a resumed run that validates at other
    steps (at its start, or not after an exit signal) trains on the same draws. Afterwards every submodule
    gets back the train/eval mode it had, also when the evaluation raises. The returned records
    are logged with ``trainer.log({prefix: records})``, so an ``EarlyStoppingHook`` can monitor
    e.g. ``"val/loss"``, kept in ``last_records``, and shown as a line on ``trainer.logger`` at
    INFO (``Validation at step 100: val/loss 0.3120 val/accuracy 0.9583``). ``trainer.evaluate()``
    (``trainloop evaluate``) runs every validation hook once on restored weights.

    In Python ``evaluate`` may be any callable; in a settings file it is the name of a trainer
    method (any name but ``train``, ``evaluate`` and ``predict``, which are the trainer's runs)::

        ValidationHook(lambda trainer: {"loss": compute_val_loss(trainer.model)}, interval=500)
        {"type": "validation", "evaluate": "val_metrics", "interval": 500}   # trainer.val_metrics()

    Every rank runs the evaluation, so it may use collectives: ``trainloop.distributed.ItemMeans``
    averages per-item values over a ``DistributedSampler``'s items, its padding left out, so every
    rank gets the numbers one process gets.

    Args:
        evaluate: ``fn(trainer) -> records`` (a nested dict of numbers or scalar tensors), or
            the name of a trainer method ``method() -> records``. A name is checked when
            training starts; a missing or non-callable attribute fails before the first step.
        interval: Evaluate after every ``interval``-th step (or epoch, see ``unit``).
        at_last_step: Also evaluate after the last step of a run that ends cleanly (``max_steps``
            or ``max_epochs`` reached, or an exit request) when it was not just evaluated.
        at_start: Also evaluate once before the first step (``restoring -> validating``), also
            when the run resumes.
        on_exit_signal: ``"skip"``: after an exit signal the run saves and exits without this
            evaluation; ``"validate"``: it evaluates the last step first.
        unit: ``"steps"`` or ``"epochs"``: what ``interval`` counts.
        prefix: The top-level key the records are logged under.

    Attributes:
        last_records: What the last evaluation returned, or ``None`` before the first.
        last_step: The step of the last evaluation, or ``None`` before the first.
    """

    @classmethod
    def check_settings(cls, declared: Any, settings: Any, trainer: Any) -> list[HookProblem]:
        """The method ``evaluate`` names exists on the trainer (see ``BaseHook.check_settings``)."""
        name = declared.evaluate
        if trainer is None or not isinstance(name, str):
            return []
        found = getattr(trainer, name, _MISSING)
        cls_name = (trainer if isinstance(trainer, type) else type(trainer)).__name__
        if name in _RUNS:
            return [("evaluate", f"{cls_name}.{name}() is a run of the trainer, not a validation method: {_RENAME}")]
        if found is _MISSING:
            methods = [
                m for m in dir(trainer)
                if not m.startswith("_") and m not in _RUNS and callable(getattr(trainer, m, None))
            ]  # never suggest a run (evaluate) for a misspelt validation method
            close = difflib.get_close_matches(name, methods, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            return [("evaluate", f"{cls_name} has no method {name!r}{hint}")]
        if not callable(found):
            return [("evaluate", f"{cls_name}.{name} is a {type(found).__name__}, not a method")]
        return []

    @validate_call
    def __init__(
        self,
        # The callable branch is validated in Python but left out of the JSON schema: a file
        # can only name a method, and pydantic cannot describe a callable in JSON schema.
        evaluate: MethodName | SkipJsonSchema[Callable[[Any], Any]],
        interval: PositiveInt,
        at_last_step: StrictBool = True,
        prefix: Annotated[str, Field(min_length=1)] = "val",
        unit: Literal["steps", "epochs"] = "steps",
        at_start: StrictBool = False,
        on_exit_signal: Literal["skip", "validate"] = "skip",
    ) -> None:
        self.evaluate = evaluate
        self.interval = interval
        self.unit = unit
        self.schedule = Schedule(
            interval, unit, at_end=at_last_step, at_start=at_start, state="validating",
            at_exit_signal=on_exit_signal == "validate",
        )
        self.at_last_step = at_last_step
        self.at_start = at_start
        self.on_exit_signal = on_exit_signal
        self.prefix = prefix
        self.last_records: Records | None = None
        self.last_step: int | None = None

    def on_before_train(self, trainer: TrainerView) -> None:
        """Check that a method named by ``evaluate`` exists on the trainer and is callable.

        Raises:
            AttributeError: The trainer has no attribute of that name.
            TypeError: The attribute is not callable, or is one of the trainer's runs (``train``,
                ``evaluate``, ``predict``).
        """
        if not isinstance(self.evaluate, str):
            return
        if self.evaluate in _RUNS:
            raise TypeError(
                f"{type(self).__name__}(evaluate={self.evaluate!r}): trainer.{self.evaluate}() is a run of the "
                f"trainer, not a validation method: {_RENAME}"
            )
        method = getattr(trainer, self.evaluate, _MISSING)
        if method is _MISSING:
            raise AttributeError(
                f"{type(self).__name__}(evaluate={self.evaluate!r}): "
                f"{type(trainer).__name__} has no method {self.evaluate!r}"
            )
        if not callable(method):
            raise TypeError(
                f"{type(self).__name__}(evaluate={self.evaluate!r}): "
                f"{type(trainer).__name__}.{self.evaluate} is a {type(method).__name__}, "
                "not a method"
            )

    def on_schedule(self, trainer: TrainerView) -> None:
        """Evaluate, in ``validating``: the schedule is due (a step that is not due never calls the hook)."""
        self.run(trainer)

    def run(self, trainer: TrainerView) -> Records:
        """Evaluate now (eval mode, no grad, autocast), log the records and return them.

        Args:
            trainer: The trainer whose model is evaluated.

        Returns:
            The records the evaluation returned.

        Raises:
            TypeError: The evaluation did not return a dict of records.
        """
        with module_modes_kept(trainer.model, train=False), torch.no_grad(), trainer.autocast():
            if isinstance(self.evaluate, str):
                records = getattr(trainer, self.evaluate)()
            else:
                records = self.evaluate(trainer)
        if not isinstance(records, Mapping):
            raise TypeError(
                f"{type(self).__name__}: the evaluation {self._describe()} returned a "
                f"{type(records).__name__}, not a dict of records"
            )
        self.last_records = cast(Records, records)
        self.last_step = trainer.step
        trainer.log({self.prefix: self.last_records})
        logger = trainer.logger
        if logger.isEnabledFor(logging.INFO):
            shown = trainer.metrics.last  # the values just logged, as floats
            keys = [k for k in flatten_nested_dict(self.last_records, prefix=self.prefix) if k in shown]
            fmt = "Validation at step %d: " + " ".join(["%s %.4g"] * len(keys))  # formatted by logging, lazily
            logger.info(fmt, trainer.step, *(x for k in keys for x in (k, shown[k])))
        return self.last_records

    def _describe(self) -> str:
        if isinstance(self.evaluate, str):
            return f"trainer.{self.evaluate}()"
        return getattr(self.evaluate, "__qualname__", repr(self.evaluate))

