"""The hook interface: the methods the engine calls, and what a hook tells the engine it needs.

``trainloop.hook_machinery.dispatch`` decides which methods run, and when.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import re
import signal
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError

from trainloop.hook_machinery.schedule import Schedule

if TYPE_CHECKING:
    from trainloop.location import Location

__all__ = ["BaseHook"]


class BaseHook:
    """Base class of everything that plugs into a trainer.

    Override only the methods you need: the trainer calls a method only on the hooks that
    override it, so an unused method costs nothing per step. Besides the methods below, a hook
    that defines ``on_enter_<state>(self, trainer)`` (for example ``on_enter_checkpointing``) is
    attached to that state of the machine. Any other ``on_*`` method is an error when the
    trainer builds its hooks (a misspelt method would otherwise silently never run).

    A hook reads the trainer but does not steer it directly; its levers are requests that the
    trainer settles at the end of a step: ``trainer.request_exit()`` and
    ``trainer.request_checkpoint()`` (a save out of turn). The run's state (``step``, ``epoch``,
    ``step_info``, ``hooks``, the built components) is the loop's: assigning it raises an ``AttributeError`` that says
    what to call instead; adding records to ``trainer.step_info`` is a hook's right.

    The ``trainer`` the methods receive is typed ``Any`` here, so that a subclass may annotate
    it with its own trainer class, with ``BaseTrainer``, or with the read-only view
    ``trainloop.core.run_state.TrainerView`` (what the built-in hooks use).

    A hook that acts periodically declares when, as data: ``self.schedule = Schedule(every=100)``
    (``trainloop.hook_machinery.schedule``), and defines ``on_schedule``; the trainer applies the one
    every(n) rule and calls ``on_schedule`` only when it is due, so the steps in between cost
    the hook nothing, and ``trainloop graph``, the docs and the run report show the schedule.

    A hook class registered for settings files checks its own declared settings before anything
    is built (``check_settings``, and ``check_together`` across the run's hooks of the class):
    ``trainloop validate``, ``trainloop run`` and ``train()`` all ask it.

    The engine never names a hook class: a hook tells it what it needs here (``writes_to``,
    ``reads_whole_parameters``, ``claimed_signals``, ``checkpoint_directory``, ``default_hook``).

    Attributes:
        schedule: When ``on_schedule`` is called, or ``None`` (the hook has no schedule).
        writes_to: The settings fields that name a directory a hook of this class writes
            (``("log_dir",)``): the preflight checks that each local one can be made and written
            (a relative one under the workspace).
        reads_whole_parameters: Whether a hook of this class reads every parameter whole between
            steps (an average of the weights): DeepSpeed's ZeRO stage 3 leaves each rank only its
            partition, so a run declaring both is refused before step 1.
    """

    _name: str | None = None
    schedule: Schedule | None = None
    writes_to: ClassVar[tuple[str, ...]] = ()
    reads_whole_parameters: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        init = cls.__dict__.get("__init__")
        if init is not None and hasattr(init, "raw_function"):  # checked by pydantic's validate_call
            cls.__init__ = _misspelt_arguments_named(init)  # type: ignore[method-assign]

    @property
    def name(self) -> str:
        """The hook's name, unique among a trainer's hooks: a checkpoint keys the hook's state by it.

        Defaults to the class name in snake case (``ema_hook``). Give two stateful hooks of one
        class names of their own (``hook.name = "ema_fast"``, or ``"name"`` in a declared hook):
        a state key must not depend on the hooks' order, so a repeated name among hooks that
        save state is an error.
        """
        return self._name or self.default_name()

    @name.setter
    def name(self, value: str) -> None:
        self._name = value

    @classmethod
    def default_name(cls) -> str:
        """The class name in snake case: ``EmaHook`` -> ``ema_hook``."""
        return re.sub(r"(?<!^)(?=[A-Z])", "_", cls.__name__).lower()

    @classmethod
    def saves_state(cls) -> bool:
        """Whether the class adds state to checkpoints (overrides ``on_state_dict``)."""
        return cls.on_state_dict is not BaseHook.on_state_dict

    @classmethod
    def check_settings(cls, declared: Any, settings: Any, trainer: Any) -> list[tuple[str | None, str]]:
        """What stops one declared hook of this class from running, found without building anything.

        Called by the preflight (``trainloop validate``, ``trainloop run``, ``train()``) for each
        hook of this class that ``settings.hooks`` declares. By default nothing.

        Args:
            declared: The hook's validated settings (``"type"`` and its parameters).
            settings: The run's validated ``TrainerSettings``.
            trainer: The trainer class (or instance) that will run them, or ``None`` when the
                settings are checked alone.

        Returns:
            One ``(parameter, message)`` per problem: the parameter at fault (``None``: the hook
            as a whole) and what is wrong; the preflight names the field (``hooks[2].path: ...``).
        """
        return []

    @classmethod
    def check_together(cls, declared: Sequence[tuple[int, Any]], settings: Any) -> list[str]:
        """What stops the run's hooks of this class from running together (two writing one directory, say).

        Called once per class that ``settings.hooks`` declares. By default nothing.

        Args:
            declared: ``(index in settings.hooks, validated settings)`` of each hook of this class.
            settings: The run's validated ``TrainerSettings``.

        Returns:
            One message per problem, naming the hooks as ``hooks[i]``.
        """
        return []

    @classmethod
    def claimed_signals(cls, declared: Any) -> list[signal.Signals]:
        """The signals one declared hook of this class claims for its own handler (by default none).

        The preflight refuses two declared hooks that claim one signal: a process has one handler
        per signal.

        Args:
            declared: The hook's validated settings.
        """
        return []

    @classmethod
    def default_hook(cls, settings: Any, hooks: Sequence[BaseHook]) -> BaseHook | None:
        """A hook of this class that a run adds by itself to ``hooks``, or ``None`` (the default).

        Asked of each registered class that defines it, when the run has built its hooks
        (``trainloop.hook_machinery.registry.with_default_hooks``).

        Args:
            settings: The run's validated ``TrainerSettings``.
            hooks: The hooks the run built and declared.
        """
        return None

    def checkpoint_directory(self, trainer: Any) -> Location | None:
        """Where this hook keeps the run's checkpoints, or ``None`` (the default: it keeps none).

        A run that loads its latest checkpoint without training (``evaluate``, ``predict``) looks there.
        """
        return None

    def on_before_train(self, trainer: Any) -> None:
        """Called once in ``restoring``, after any checkpoint was loaded."""

    def on_before_step(self, trainer: Any) -> None:
        """Called when a new step begins (the ``begin_step`` edge into ``accumulating``).

        Not called again when the step is retried.
        """

    def on_before_optimizer_step(self, trainer: Any) -> None:
        """Called in ``stepping``, gradients unscaled and normalised, before clipping."""

    def on_after_step(self, trainer: Any) -> None:
        """Called in ``stepping`` after the optimizer and scheduler stepped; ``trainer.step_info`` is complete.

        Never called for an update that found non-finite gradients.
        """

    def on_schedule(self, trainer: Any) -> None:
        """Called when ``self.schedule`` is due, in the state it names.

        A ``stepping`` schedule: right after this hook's ``on_after_step`` (at the end of a run ended by an exit
        request, in ``exiting`` right before its ``on_after_train``; with ``at_start``, in ``restoring`` right after
        its ``on_before_train``). A ``validating`` or ``checkpointing`` schedule: in that state, which the machine
        enters for it after ``stepping`` (see docs/hooks.md).
        """

    def on_exception(self, trainer: Any, error: BaseException) -> None:
        """Called in ``exiting`` when the run ends by an error (or an interrupt), before ``on_after_train``.

        ``error`` is what ``train()`` re-raises afterwards.
        """

    def on_after_train(self, trainer: Any) -> None:
        """Called in ``exiting``, however the run ends (after ``on_exception`` for an error)."""

    def on_log(self, trainer: Any, records: dict[str, Any]) -> None:
        """Receive the nested numeric records given to ``trainer.log``."""

    def on_log_images(self, trainer: Any, records: dict[str, Any]) -> None:
        """Receive the images given to ``trainer.log_images``."""

    def on_state_dict(self, trainer: Any, state_dict: dict[str, Any]) -> None:
        """Add this hook's state to the trainer's ``state_dict`` (key it by ``self.name``)."""

    def on_load_state_dict(self, trainer: Any, state_dict: dict[str, Any]) -> None:
        """Restore this hook's state from a trainer ``state_dict``."""


def _misspelt_arguments_named(init: Callable[..., None]) -> Callable[..., None]:
    """``init`` whose pydantic error names a misspelt keyword's likely meaning.

    ``CheckpointingHook(intervl=3)`` then says ``unknown argument 'intervl'; did you mean
    'interval'?`` once, instead of pydantic's two errors (an unexpected keyword and a missing
    argument). The error stays a ``pydantic.ValidationError``.
    """
    parameters = [p for p in inspect.signature(init.raw_function).parameters if p != "self"]  # type: ignore[attr-defined]

    @functools.wraps(init)
    def checked_init(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            init(self, *args, **kwargs)
        except ValidationError as error:
            if not any(item["type"] == "unexpected_keyword_argument" for item in error.errors()):
                raise
            raise _in_our_words(error, parameters) from None

    return checked_init


def _in_our_words(error: ValidationError, parameters: list[str]) -> ValidationError:
    items = error.errors(include_url=False)
    meant: set[str] = set()
    details: list[InitErrorDetails] = []
    for item in items:
        if item["type"] == "unexpected_keyword_argument":
            name = str(item["loc"][-1])
            close = difflib.get_close_matches(name, parameters, n=1, cutoff=0.6)
            meant.update(close)
            hint = f"; did you mean {close[0]!r}?" if close else f"; its arguments are {', '.join(parameters)}"
            text = f"unknown argument {name!r}{hint}"
            item = {**item, "type": PydanticCustomError("unknown_argument", "{text}", {"text": text})}  # type: ignore[typeddict-item]
        details.append(item)  # type: ignore[arg-type]
    # The argument a misspelt keyword meant is "missing" only because of the misspelling: one error says both.
    details = [d for d in details if not (d["type"] == "missing_argument" and d["loc"][-1] in meant)]
    try:
        return ValidationError.from_exception_data(error.title, details)
    except KeyError:  # an error type pydantic cannot build again (path_type): keep its own words
        return error
