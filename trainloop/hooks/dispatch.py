"""Which hook methods exist, which state each runs in, and the dispatch table that calls only the
hooks that override a method."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Sequence
from typing import Any

from trainloop.hooks.base import BaseHook
from trainloop.machine.table import State

__all__ = ["HOOK_EVENTS", "HOOK_METHODS", "check_hook_methods", "check_hooks", "hook_dispatch", "state_entry_methods"]


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
