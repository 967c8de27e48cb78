"""The one "every N" rule of hooks that act periodically, and the ``Schedule`` that declares it.

A hook declares when it acts as data (``hook.schedule = Schedule(every=n)``) and defines
``on_schedule(trainer)``; the loop asks the dispatcher (``trainloop.hook_machinery.dispatch``) what is due
and calls it, so a step on which nothing is due costs the hook nothing. docs/hooks.md has the
rule in full: multiples of ``every`` steps or epochs (and ``also_every``/``also_at`` steps), the
last step of a run that ends cleanly (``at_end``), once before the first step (``at_start``);
``state`` says whether ``on_schedule`` runs in ``stepping`` or in a state of its own
(``validating``, ``checkpointing``) that the machine enters for it.

The rule's bookkeeping over a run (``Every``) and its application (``ScheduledCalls``) are
:mod:`trainloop.hook_machinery.dispatch`'s.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

__all__ = ["QUEUED_STATES", "Schedule", "ScheduleState", "Unit"]

Unit = Literal["steps", "epochs"]
ScheduleState = Literal["stepping", "validating", "checkpointing"]

#: The states a schedule's calls wait in until the machine enters them (``stepping`` acts in place).
QUEUED_STATES: tuple[ScheduleState, ...] = ("validating", "checkpointing")


@dataclass(frozen=True)
class Schedule:
    """When a hook acts: what a hook declares, what the dispatcher applies and the docs show.

    Args:
        every: Act after every multiple of this many steps (or epochs), ``>= 1``.
        unit: ``"steps"``, or ``"epochs"``: act after the step in which every ``every``-th
            epoch's last batch is drawn.
        at_end: Also act after the last step of a run that ends cleanly, when not just acted on.
        at_start: Also act once before the first step (in ``restoring``, or in ``validating``
            right after it).
        state: Where ``on_schedule`` runs: ``"stepping"`` (right after the hook's
            ``on_after_step``), or ``"validating"`` or ``"checkpointing"`` (the machine enters
            that state to run it, after ``stepping``).
        at_exit_signal: Whether a run ending on an exit signal (an exit request with an exit
            code) is still acted on: at its last step, and at its end. ``False`` leaves fast.
        also_every: Also act after every multiple of this many steps (0: no), whatever ``unit``.
        also_at: Also act after these steps.

    Raises:
        ValueError: ``every`` is not a whole number of at least 1 (``2.5``, ``inf``, ``True``),
            ``also_every`` or a step of ``also_at`` not a whole number of at least 0 or 1, a flag
            not a bool, ``unit`` or ``state`` unknown, or ``at_start`` asked of
            ``checkpointing`` (nothing to save before the first step). The message names the
            argument and its value.
    """

    every: int
    unit: Unit = "steps"
    at_end: bool = True
    at_start: bool = False
    state: ScheduleState = "stepping"
    at_exit_signal: bool = True
    also_every: int = 0
    also_at: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        _count("every", self.every, least=1)
        _count("also_every", self.also_every, least=0)
        if self.unit not in ("steps", "epochs"):
            raise ValueError(f"Schedule unit={self.unit!r}: a schedule's unit is 'steps' or 'epochs'")
        if self.state not in ("stepping", *QUEUED_STATES):
            raise ValueError(
                f"Schedule state={self.state!r}: a schedule's state is 'stepping', 'validating' or 'checkpointing'"
            )
        for name in ("at_end", "at_start", "at_exit_signal"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Schedule {name}={getattr(self, name)!r}: give True or False")
        if isinstance(self.also_at, (str, bytes)) or not isinstance(self.also_at, Iterable):
            raise ValueError(f"Schedule also_at={self.also_at!r}: give a set of step numbers")
        steps = frozenset(self.also_at)
        for step in sorted(steps, key=repr):
            _count("also_at", step, least=1)
        object.__setattr__(self, "also_at", steps)  # a list or set given: held as the frozenset it means
        if self.at_start and self.state == "checkpointing":
            raise ValueError("a checkpointing schedule cannot act at_start: there is nothing to save yet")

    def describe(self) -> str:
        """The schedule in words: ``every 1000 steps and at the end``, ``at the start and every epoch``."""
        one = self.unit.removesuffix("s")
        periodic = [f"every {one}" if self.every == 1 else f"every {self.every} {self.unit}"]
        if self.also_every:
            periodic.append(f"every {self.also_every} steps")
        if self.also_at:
            steps = ", ".join(map(str, sorted(self.also_at)))
            periodic.append(f"at steps {steps}" if len(self.also_at) > 1 else f"at step {steps}")
        parts = (["at the start"] if self.at_start else []) + periodic + (["at the end"] if self.at_end else [])
        return ", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else parts[0]


def _count(name: str, value: object, least: int) -> None:
    """Refuse ``value`` unless it is an ``int`` (not a bool) of at least ``least``.

    ``2.5`` would act at 5, 10, ...; ``inf`` only at the end; ``True`` reads as 1: each is a
    mistake, refused where the schedule is made, with the value as written.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        if name == "also_at":
            raise ValueError(f"Schedule also_at holds {value!r}: each is a step number, a whole number of at least 1")
        if name == "also_every":
            raise ValueError(f"Schedule also_every={value!r}: also_every is a whole number of steps, 0 (none) or more")
        raise ValueError(f"Schedule {name}={value!r}: {name} is a whole number of steps or epochs, at least {least}")
