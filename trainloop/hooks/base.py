"""The hook interface, and the dispatch table that calls only the hooks that care."""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ..machine import State

if TYPE_CHECKING:
    from ..trainer import BaseTrainer

__all__ = ["BaseHook", "HOOK_EVENTS", "HOOK_METHODS", "check_hook_methods", "check_hooks", "hook_dispatch", "state_entry_methods"]


class BaseHook:
    """Base class of everything that plugs into a trainer.

    Override only the methods you need: the trainer calls a method only on the hooks that
    override it, so an unused method costs nothing per step. Besides the methods below, a hook
    that defines ``on_enter_<state>(self, trainer)`` (for example ``on_enter_checkpointing``) is
    attached to that state of the machine. Any other ``on_*`` method is an error when the
    trainer builds its hooks (a misspelt method would otherwise silently never run).

    A hook reads the trainer but does not steer it directly; its levers are requests that the
    trainer settles at the end of a step: ``trainer.request_checkpoint()`` and
    ``trainer.request_exit()``.
    """

    _name: str | None = None

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

    def on_before_train(self, trainer: BaseTrainer) -> None:
        """Called once in ``restoring``, after any checkpoint was loaded."""

    def on_before_step(self, trainer: BaseTrainer) -> None:
        """Called when a new step begins (the ``begin_step`` edge into ``accumulating``; not
        again when the step is retried)."""

    def on_before_optimizer_step(self, trainer: BaseTrainer) -> None:
        """Called in ``stepping``, gradients unscaled and normalised, before clipping."""

    def on_after_step(self, trainer: BaseTrainer) -> None:
        """Called in ``stepping`` after the optimizer and scheduler stepped (never for an update
        that found non-finite gradients); ``trainer.step_info`` is complete."""

    def on_exception(self, trainer: BaseTrainer, error: BaseException) -> None:
        """Called in ``exiting`` when the run ends by an error (or an interrupt), before
        ``on_after_train``; ``error`` is what ``train()`` re-raises afterwards."""

    def on_after_train(self, trainer: BaseTrainer) -> None:
        """Called in ``exiting``, however the run ends (after ``on_exception`` for an error)."""

    def on_log(self, trainer: BaseTrainer, records: dict[str, Any]) -> None:
        """Receive the nested numeric records given to ``trainer.log``."""

    def on_log_images(self, trainer: BaseTrainer, records: dict[str, Any]) -> None:
        """Receive the images given to ``trainer.log_images``."""

    def on_state_dict(self, trainer: BaseTrainer, state_dict: dict[str, Any]) -> None:
        """Add this hook's state to the trainer's ``state_dict`` (key it by ``self.name``)."""

    def on_load_state_dict(self, trainer: BaseTrainer, state_dict: dict[str, Any]) -> None:
        """Restore this hook's state from a trainer ``state_dict``."""


#: The methods a trainer dispatches to hooks, and the one state each runs in (``None``: whenever
#: the trainer's method that dispatches it is called). The docs' table is generated from this,
#: and a test checks real runs against it.
HOOK_EVENTS: dict[str, State | None] = {
    "on_before_train": State.RESTORING,
    "on_before_step": State.ACCUMULATING,  # by the begin_step edge, before the first microstep
    "on_before_optimizer_step": State.STEPPING,
    "on_after_step": State.STEPPING,  # only after an applied update
    "on_exception": State.EXITING,  # an error ended the run; before on_after_train
    "on_after_train": State.EXITING,
    "on_log": None,  # trainer.log()
    "on_log_images": None,  # trainer.log_images()
    "on_state_dict": None,  # trainer.state_dict()
    "on_load_state_dict": None,  # trainer.load_state_dict()
}


def state_entry_methods(hook: BaseHook) -> list[tuple[State, Callable[[Any], Any]]]:
    """The ``on_enter_<state>`` methods a hook defines, with their states."""
    found = []
    for state in State:
        method = getattr(hook, f"on_enter_{state.value}", None)
        if callable(method):
            found.append((state, method))
    return found


def hook_dispatch(hooks: Sequence[BaseHook]) -> dict[str, tuple[Callable[..., None], ...]]:
    """Per event, the bound methods of the hooks that override it, in hook order.

    Built once, so a step pays only for the hooks that act on it.
    """
    return {
        event: tuple(
            getattr(h, event) for h in hooks if getattr(type(h), event) is not getattr(BaseHook, event)
        )
        for event in HOOK_EVENTS
    }


def check_hooks(hooks: list[BaseHook]) -> None:
    """Check a run's hooks: their types, their method names, and that their names are unique.

    Raises:
        TypeError: An item is not a ``BaseHook``, or a hook defines an ``on_*`` method that is no
            hook method (a typo would otherwise never be called); the message suggests the
            closest one.
        ValueError: Two hooks that save state have one name (checkpoints key each hook's state
            by its name).
    """
    classes: dict[str, list[str]] = {}
    for i, hook in enumerate(hooks):
        if not isinstance(hook, BaseHook):
            raise TypeError(f"build_hooks() item {i} is a {type(hook).__name__}, not a BaseHook")
        check_hook_methods(type(hook))
        if hook.saves_state():  # only saved state needs a unique key
            classes.setdefault(hook.name, []).append(type(hook).__name__)
    for name, kinds in classes.items():
        if len(kinds) > 1:
            raise ValueError(
                f"{len(kinds)} hooks are named {name!r} ({', '.join(kinds)}): give each a name of its "
                "own (hook.name = ..., or \"name\" in a declared hook), since a checkpoint keys "
                "each hook's state by its name"
            )


#: Every ``on_*`` method name a hook may define.
HOOK_METHODS = frozenset(HOOK_EVENTS) | {f"on_enter_{state.value}" for state in State}


def check_hook_methods(cls: type[BaseHook]) -> None:
    """Raise ``TypeError`` if ``cls`` defines an ``on_*`` method that is no hook method."""
    for name in dir(cls):
        if name.startswith("on_") and name not in HOOK_METHODS and callable(getattr(cls, name)):
            close = difflib.get_close_matches(name, sorted(HOOK_METHODS), n=1)
            hint = f"; did you mean {close[0]}?" if close else f"; hook methods are {', '.join(sorted(HOOK_METHODS))}"
            raise TypeError(f"{cls.__name__}.{name} is not a hook method, so it would never be called{hint}")
