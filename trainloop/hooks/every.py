"""The one "every N" rule of hooks that act periodically, and the ``Schedule`` that declares it.

A hook declares when it acts as data, ``hook.schedule = Schedule(every=n, unit="steps")``, and
defines ``on_schedule(trainer)``; the dispatcher (``trainloop.hooks.dispatch``) applies this
rule and calls ``on_schedule`` only when it is due:

- after a step that is a multiple of ``every`` steps (or completes a multiple of ``every``
  epochs), right after the hook's own ``on_after_step``;
- with ``at_end``, after the last step of a run that ends cleanly, so the end of a run is never
  left out: a run that reaches ``max_steps`` or ``max_epochs`` is due at its last step; a run
  that ends on an exit request (a signal, early stopping) learns it after the step's hooks ran,
  so its last step, if not acted on, is acted on in ``exiting``, before the hook's
  ``on_after_train``; a run that ends by an error is not acted on (other ranks may not get there);
- with ``at_start``, once in ``restoring``, right after the hook's own ``on_before_train``.

A schedule declared ``state="validating"`` (``ValidationHook``'s) is not acted on in place: each
time it is due, the machine enters ``validating`` and acts there (after ``restoring`` for
``at_start``; before ``exiting`` for the end of a run ended by an exit request), so its time is
its own in traces and reports. A run that ends on an exit signal (an exit request with an exit
code) is not acted on at its end, nor at its last step, unless ``at_exit_signal``.

``Every`` is the rule's bookkeeping for one schedule over one run: pure arithmetic on the numbers
the dispatcher gives it, so it can be tested, and skipped on steps where nothing is due.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["Every", "Schedule", "ScheduleState", "Unit"]

Unit = Literal["steps", "epochs"]
ScheduleState = Literal["stepping", "validating"]


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
            ``on_after_step``) or ``"validating"`` (the machine enters that state to run it).
        at_exit_signal: Whether a run ending on an exit signal (an exit request with an exit
            code) is still acted on: at its last step, and at its end. ``False`` leaves fast.

    Raises:
        ValueError: ``every`` is less than 1, or ``unit`` is neither ``"steps"`` nor ``"epochs"``.
    """

    every: int
    unit: Unit = "steps"
    at_end: bool = True
    at_start: bool = False
    state: ScheduleState = "stepping"
    at_exit_signal: bool = True

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError(f"every(n) needs n >= 1, got {self.every}")
        if self.unit not in ("steps", "epochs"):
            raise ValueError(f"a schedule's unit is 'steps' or 'epochs', got {self.unit!r}")
        if self.state not in ("stepping", "validating"):
            raise ValueError(f"a schedule's state is 'stepping' or 'validating', got {self.state!r}")

    def describe(self) -> str:
        """The schedule in words: ``every 1000 steps and at the end``, ``at the start and every epoch``."""
        one = self.unit.removesuffix("s")
        periodic = f"every {one}" if self.every == 1 else f"every {self.every} {self.unit}"
        parts = (["at the start"] if self.at_start else []) + [periodic] + (["at the end"] if self.at_end else [])
        return ", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else parts[0]


class Every:
    """The every(n) rule over one run, for one schedule.

    Args:
        n: Act at every multiple of this many steps (or epochs).
        unit: ``"steps"`` or ``"epochs"``.
        at_end: Whether the last step of a run counts (the rule); ``False``: only multiples of ``n``.

    Attributes:
        last_step: The step at which ``due`` or ``due_at_end`` last said yes, or ``None``.
    """

    def __init__(self, n: int, unit: Unit = "steps", at_end: bool = True) -> None:
        self.schedule = Schedule(n, unit, at_end)  # checks n and unit
        self.n = n
        self.unit = unit
        self.at_end = at_end
        self.last_step: int | None = None
        self._epochs: int | None = None  # epochs completed after the last step seen

    def start(self) -> None:
        """Begin a run: epochs are counted from the first step's ``epochs_at_start``."""
        self.last_step = None
        self._epochs = None

    def due(self, step: int, epochs: int, epochs_at_start: int, last: bool) -> bool:
        """Whether to act after ``step``.

        Args:
            step: The step that just finished.
            epochs: Full passes over the data completed now.
            epochs_at_start: Full passes completed when the run began drawing.
            last: Whether the run ends after this step (``max_steps``/``max_epochs`` reached).
        """
        if self.unit == "steps":
            hit = step % self.n == 0
        else:
            before = epochs_at_start if self._epochs is None else self._epochs
            hit = epochs > before and epochs % self.n == 0
            self._epochs = epochs
        if hit or (self.at_end and last):
            self.last_step = step
            return True
        return False

    def next_step(self, step: int) -> int:
        """The first step after ``step`` that a ``"steps"`` schedule is due at by its multiples."""
        return (step // self.n + 1) * self.n

    def due_at_end(self, step: int) -> bool:
        """Whether a run that ended cleanly after ``step`` left it not acted on (``at_end`` only)."""
        if not self.at_end or step == self.last_step:
            return False
        self.last_step = step
        return True
