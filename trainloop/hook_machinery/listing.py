"""Each hook beside the state it acts in, with its schedule in words.

``trainloop graph --settings``, the docs' tables and the run report show the declared hooks this
way: ``checkpointing — CheckpointingHook, in checkpointing, every 1000 steps and at the end``,
``validation — ValidationHook, in validating, every 500 steps and at the end``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import ValidationError

from trainloop.hook_machinery.base import BaseHook
from trainloop.hook_machinery.dispatch import HOOK_EVENTS
from trainloop.hook_machinery.registry import HookSettings, hook_class, hook_settings_model
from trainloop.machine.table import State

__all__ = ["declared_hook_lines", "hook_line", "hook_notes"]

#: Where a hook without a schedule acts, by the first method it overrides in this order.
_ACTS = {
    "on_after_step": "after stepping, every step",
    "on_before_step": "before each step",
    "on_before_optimizer_step": "before each optimizer update",
    "on_log": "on each trainer.log()",
    "on_log_images": "on each trainer.log_images()",
    "on_before_train": "before the first step",
    "on_after_train": "at the end",
    "on_exception": "on an error",
}


def _display_name(hook: BaseHook) -> str:
    """The name a settings file gives the hook: its ``"name"``, else its registered type."""
    default = hook.default_name()
    return getattr(type(hook), "hook_type", default) if hook.name == default else hook.name


def hook_line(hook: BaseHook, name: str | None = None) -> tuple[State | None, str]:
    """Where ``hook`` acts and the line that says so.

    Args:
        hook: A built hook.
        name: The name to show; by default its declared ``"name"`` or its registered type.

    Returns:
        The state it acts in (``None``: whenever a trainer method is called, such as ``log``) and
        ``"<name> — <Class>, <where>, <when>"``.
    """
    head = f"{name or _display_name(hook)} — {type(hook).__name__}"
    schedule = hook.schedule
    if schedule is not None:
        if schedule.state != "stepping":
            signal = "" if schedule.at_exit_signal or not schedule.at_end else " (not after an exit signal)"
            return State(schedule.state), f"{head}, in {schedule.state}, {schedule.describe()}{signal}"
        return State.STEPPING, f"{head}, after stepping, {schedule.describe()}"
    cls = type(hook)
    for event, words in _ACTS.items():
        if getattr(cls, event) is not getattr(BaseHook, event):
            return HOOK_EVENTS[event], f"{head}, {words}"
    for state in State:
        if callable(getattr(hook, f"on_enter_{state.value}", None)):
            return state, f"{head}, on entering {state.value}"
    return None, f"{head}, never (it overrides no hook method)"


def declared_hook_lines(declared: Iterable[HookSettings | Mapping[str, Any]]) -> list[tuple[State | None, str]]:
    """``hook_line`` of each declared hook, built from its declaration (nothing runs).

    Args:
        declared: ``settings.hooks``, or their JSON form (a run's saved ``settings.json``); a
            type this process has not registered, or a declaration that no longer validates, is
            listed as such rather than guessed at.
    """
    lines = []
    for entry in declared:
        if isinstance(entry, HookSettings):
            lines.append(hook_line(entry.build(), entry.name or entry.type))
            continue
        type_name, name = entry.get("type"), entry.get("name")
        shown = name or type_name
        cls = hook_class(type_name) if isinstance(type_name, str) else None
        if cls is None:
            lines.append((None, f"{shown} — hook type {type_name!r} is not registered here: its schedule is unknown"))
            continue
        try:
            # mypy reads a class held in a variable as not Hashable (see registry._validate_spec).
            spec = hook_settings_model(cls).model_validate_json(json.dumps(entry))  # type: ignore[arg-type]
        except ValidationError as error:
            lines.append(
                (None, f"{shown} — {cls.__name__}, a declaration that does not validate ({error.error_count()} errors)")
            )
            continue
        lines.append(hook_line(spec.build(), shown))
    return lines


def hook_notes(lines: Iterable[tuple[State | None, str]]) -> dict[State, list[str]]:
    """The lines of hooks that act in a state, by that state (for a drawing of the machine)."""
    notes: dict[State, list[str]] = {}
    for state, line in lines:
        if state is not None:
            notes.setdefault(state, []).append(line)
    return notes
