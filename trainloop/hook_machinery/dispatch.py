"""Which hook methods exist, which state each runs in, and the dispatch that calls them.

The table calls only the hooks that override a method; ``ScheduledCalls`` applies the one every(n) rule (``Every``)
to the hooks' declared ``Schedule``s, so a hook's ``on_schedule`` runs only when due, in the state it names.
"""

from __future__ import annotations

import difflib
import sys
from collections.abc import Callable, Sequence
from typing import Any

from trainloop.hook_machinery.base import BaseHook
from trainloop.hook_machinery.schedule import QUEUED_STATES, Schedule, Unit
from trainloop.machine.table import State

__all__ = [
    "Every",
    "HOOK_EVENTS",
    "HOOK_METHODS",
    "ScheduledCalls",
    "call_each",
    "hook_dispatch",
    "hook_problems",
    "method_problem",
    "schedule_problem",
    "state_entry_methods",
]


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


def _overrides(hook: BaseHook, method: str) -> bool:
    return getattr(type(hook), method) is not getattr(BaseHook, method)


def hook_dispatch(
    hooks: Sequence[BaseHook], calls: ScheduledCalls | None = None
) -> dict[str, tuple[Callable[..., None], ...]]:
    """Per event, the bound methods of the hooks that override it, in hook order.

    Built once, so a step pays only for the hooks that act on it. When a hook declares a
    ``schedule``, ``on_before_train``, ``on_after_step`` and ``on_after_train`` are each one call
    of a ``ScheduledCalls`` (``calls``, or a new one), which also calls (or, for a ``validating``
    schedule, queues) ``on_schedule`` when due, in hook order.
    """
    dispatch = {event: tuple(getattr(h, event) for h in hooks if _overrides(h, event)) for event in HOOK_EVENTS}
    if any(h.schedule is not None for h in hooks):
        calls = calls if calls is not None else ScheduledCalls(hooks)
        dispatch.update(
            on_before_train=(calls.before_train,),
            on_after_step=(calls.after_step,),
            on_after_train=(calls.after_train,),
        )
    return dispatch


class Every:
    """The every(n) rule over one run, for one schedule.

    Args:
        schedule: The hook's declared schedule (checked when it was made): its ``every`` (``n``
            here), ``unit``, ``at_end`` (whether the last step of a run counts), ``also_every``
            and ``also_at``.

    Attributes:
        last_step: The step at which ``due`` or ``due_at_end`` last said yes, or ``None``.
    """

    def __init__(self, schedule: Schedule) -> None:
        self.n = schedule.every
        self.unit: Unit = schedule.unit
        self.at_end = schedule.at_end
        self.also_every = schedule.also_every
        self.also_at = schedule.also_at
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
        hit = hit or (self.also_every > 0 and step % self.also_every == 0) or step in self.also_at
        if hit or (self.at_end and last):
            self.last_step = step
            return True
        return False

    def next_step(self, step: int) -> int:
        """The first step after ``step`` that the schedule is due at by its steps (multiples and ``also_*``).

        For an ``"epochs"`` schedule, only its ``also_*`` steps count (epochs are watched apart).
        """
        candidates = [(step // self.n + 1) * self.n] if self.unit == "steps" else []
        if self.also_every:
            candidates.append((step // self.also_every + 1) * self.also_every)
        candidates += [s for s in self.also_at if s > step]
        return min(candidates, default=sys.maxsize)

    def mark(self, step: int) -> None:
        """Note that the hook acted after ``step`` out of turn (a requested save), so the end does not repeat it."""
        self.last_step = step

    def due_at_end(self, step: int) -> bool:
        """Whether a run that ended cleanly after ``step`` left it not acted on (``at_end`` only)."""
        if not self.at_end or step == self.last_step:
            return False
        self.last_step = step
        return True


_Act = Callable[[Any], Any]


class ScheduledCalls:
    """The hooks' schedules in one run: the one every(n) rule, applied once, asked by the loop what is due.

    A ``stepping`` schedule's ``on_schedule`` runs in place, right after its hook's own
    ``on_after_step`` (or ``on_before_train`` for ``at_start``), so the hooks keep their order. A
    ``validating`` or ``checkpointing`` schedule's call is queued in ``due[state]`` instead: the
    loop's edge conditions read the queue, and the work of that state runs it (``run_due``). The
    end of a run ended by an exit request is queued when the loop learns of it (``exit_agreed``);
    a ``stepping`` schedule's end runs in ``exiting``, before its hook's ``on_after_train``. A step
    on which nothing is due costs a comparison besides the hooks' own ``on_after_step``.

    Args:
        hooks: The run's hooks, in order.

    Attributes:
        due: Per queued state, the ``on_schedule`` calls due now, in hook order.
    """

    def __init__(self, hooks: Sequence[BaseHook]) -> None:
        rows: list[tuple[BaseHook, Every | None, str]] = []
        for hook in hooks:
            s = hook.schedule
            every = Every(s) if s is not None else None
            rows.append((hook, every, s.state if s is not None else "stepping"))
        self._everies = [every for _, every, _ in rows if every is not None]
        self._by_steps = [e for e in self._everies if e.unit == "steps" or e.also_every or e.also_at]
        self._start = tuple(
            (h.on_before_train if _overrides(h, "on_before_train") else None,
             h.on_schedule if h.schedule is not None and h.schedule.at_start else None, state)
            for h, _, state in rows
        )
        self._plain = tuple(h.on_after_step for h, _, _ in rows if _overrides(h, "on_after_step"))
        self._step = tuple(
            (h.on_after_step if _overrides(h, "on_after_step") else None, every, h.on_schedule, state)
            for h, every, state in rows if every is not None or _overrides(h, "on_after_step")
        )
        self._end = tuple(
            (every if state == "stepping" else None, h.on_schedule, _at_exit_signal(h),
             h.on_after_train if _overrides(h, "on_after_train") else None)
            for h, every, state in rows if every is not None or _overrides(h, "on_after_train")
        )
        # The queued schedules: (every, on_schedule, acted on after an exit signal, state), in hook order.
        self._queued = tuple(
            (every, h.on_schedule, _at_exit_signal(h), state)
            for h, every, state in rows if every is not None and state in QUEUED_STATES
        )
        self.due: dict[str, list[_Act]] = {state: [] for state in QUEUED_STATES}
        self._next = 0  # the first step at which something may be due
        self._epochs: int | None = None  # epochs completed when something was last worked out
        self._watch_epochs = False
        self._stepped = False

    def acts_in(self, state: str) -> bool:
        """Whether any hook's schedule acts in ``state``."""
        return any(where == state for *_, where in self._queued)

    def before_train(self, trainer: Any) -> None:
        """Begin the run: reset the rule; each hook's ``on_before_train``, then ``on_schedule`` if ``at_start``."""
        for every in self._everies:
            every.start()
        self._next, self._epochs, self._stepped = 0, None, False
        for queue in self.due.values():
            queue.clear()
        run_length = trainer.run_length
        # Epochs matter when a schedule counts them, or when max_epochs may end the run.
        self._watch_epochs = any(
            e.unit == "epochs" or (e.at_end and run_length.max_epochs is not None) for e in self._everies
        )
        for before, at_start, state in self._start:
            if before is not None:
                before(trainer)
            if at_start is not None and state in self.due:
                self.due[state].append(at_start)
            elif at_start is not None:
                at_start(trainer)

    def after_step(self, trainer: Any) -> None:
        """Each hook's ``on_after_step``, then its ``on_schedule`` if due after this step (or queue it)."""
        step = trainer.step
        if step < self._next and (not self._watch_epochs or trainer.run_length.epochs_completed == self._epochs):
            for fn in self._plain:  # nothing due: the hooks' own methods only
                fn(trainer)
            return
        run_length = trainer.run_length
        epochs, at_start, last = run_length.epochs_completed, run_length.epochs_at_start, run_length.reached(step)
        self._epochs, self._stepped = epochs, True
        for after, every, act, state in self._step:
            if after is not None:
                after(trainer)
            if every is None or not every.due(step, epochs, at_start, last):
                continue
            if state in self.due:
                self.due[state].append(act)
            else:
                act(trainer)
        upcoming = [every.next_step(step) for every in self._by_steps]
        if run_length.max_steps is not None and any(e.at_end for e in self._everies):
            upcoming.append(run_length.max_steps)
        self._next = min(upcoming, default=sys.maxsize)

    def exit_agreed(self, trainer: Any) -> None:
        """The run ends after this step by an exit request: queue what its end is due.

        After an exit signal (an exit request with an exit code) the run leaves fast: the queued
        calls due at this step are dropped, and none is queued for the end, except those whose
        schedule says ``at_exit_signal`` (a save, by default).
        """
        signal = trainer.exit_code is not None
        keep = {_key(act) for _, act, at_signal, _ in self._queued if at_signal or not signal}
        for queue in self.due.values():
            # Bound methods are made anew on each access: compare the functions and their hooks.
            queue[:] = [fn for fn in queue if _key(fn) in keep]
        if not self._stepped:  # no step ran (or none was looked at): nothing ended to act on
            return
        for every, act, _, state in self._queued:
            queue = self.due[state]
            if _key(act) in keep and _key(act) not in {_key(fn) for fn in queue} and every.due_at_end(trainer.step):
                queue.append(act)

    def queue_all(self, state: str, step: int) -> None:
        """Queue every ``state`` schedule's ``on_schedule`` once, in hook order (a requested save, an evaluate run).

        A schedule queued or acted on at ``step`` already is left out: a second request at one step asks nothing new.
        """
        queue = self.due[state]
        queued = {_key(fn) for fn in queue}
        for every, act, _, where in self._queued:
            if where == state and _key(act) not in queued and every.last_step != step:
                queue.append(act)
                every.mark(step)

    def acted_at(self, state: str, step: int) -> bool:
        """Whether a ``state`` schedule acted (or was queued to) at ``step``."""
        return any(where == state and every.last_step == step for every, _, _, where in self._queued)

    def run_due(self, state: str, trainer: Any) -> None:
        """Run the calls queued for ``state``, in order (the work of that state)."""
        queue = self.due[state]
        while queue:
            queue.pop(0)(trainer)

    def after_train(self, trainer: Any) -> None:
        """Each hook's ``on_schedule`` if the clean end of the run was not acted on, then its ``on_after_train``.

        Every hook's end runs even when another's raised (each may have something to give back,
        such as signal handlers); then the first error is raised, the later ones noted on it.
        The queued schedules' end was queued by ``exit_agreed`` and ran in their state.
        """
        # Not after an error: other ranks may not reach this point, and a collective would hang.
        clean = self._stepped and trainer.error is None
        signal = trainer.exit_code is not None
        step = trainer.step
        errors: list[BaseException] = []
        for every, act, at_signal, after in self._end:
            if clean and every is not None and (at_signal or not signal) and every.due_at_end(step):
                errors += call_each((act,), trainer)
            if after is not None:
                errors += call_each((after,), trainer)
        if errors:
            for later in errors[1:]:
                errors[0].add_note(f"At the end of the run another hook raised {type(later).__name__}: {later}")
            raise errors[0]


def _at_exit_signal(hook: BaseHook) -> bool:
    return hook.schedule is None or hook.schedule.at_exit_signal


def _key(fn: Any) -> int:
    """One number per hook method, the same for every bound method made of it."""
    return id(getattr(fn, "__self__", fn))


def call_each(fns: Sequence[Callable[..., Any]], *args: Any) -> list[BaseException]:
    """Call every one of ``fns`` with ``args``, even after one raises; return what they raised."""
    errors = []
    for fn in fns:
        try:
            fn(*args)
        except BaseException as error:  # noqa: BLE001 - collected; the caller raises or logs them
            errors.append(error)
    return errors


def hook_problems(hooks: list[BaseHook]) -> list[str]:
    """What stops a run's hooks from running, one line per problem (none: they can run).

    An item that is no ``BaseHook``; an ``on_*`` method that is no hook method (a typo would never be called; the
    line suggests the closest one); a schedule without ``on_schedule`` or the reverse (either half alone never
    acts); two hooks that save state under one name (a checkpoint keys each hook's state by its name).
    """
    problems: list[str] = []
    classes: dict[str, list[str]] = {}
    for i, hook in enumerate(hooks):
        if not isinstance(hook, BaseHook):
            problems.append(f"build_hooks() item {i} is a {type(hook).__name__}, not a BaseHook")
            continue
        problems += [problem for problem in (method_problem(type(hook)), schedule_problem(hook)) if problem]
        if hook.saves_state():  # only saved state needs a unique key
            classes.setdefault(hook.name, []).append(type(hook).__name__)
    problems += [
        f"{len(kinds)} hooks are named {name!r} ({', '.join(kinds)}): give each a name of its own (hook.name = ..., "
        "or \"name\" in a declared hook), since a checkpoint keys each hook's state by its name"
        for name, kinds in classes.items() if len(kinds) > 1
    ]
    return problems


#: Every ``on_*`` method name a hook may define.
HOOK_METHODS = frozenset(HOOK_EVENTS) | {"on_schedule"} | {f"on_enter_{state.value}" for state in State}


def schedule_problem(hook: BaseHook) -> str | None:
    """Whether ``hook`` declares a schedule without ``on_schedule``, or the reverse: either half alone never acts."""
    scheduled, acts = hook.schedule is not None, _overrides(hook, "on_schedule")
    if scheduled and not acts:
        return f"{type(hook).__name__} declares a schedule but no on_schedule() method to call when it is due"
    if acts and not scheduled:
        return f"{type(hook).__name__}.on_schedule would never be called: the hook declares no schedule"
    return None


def method_problem(cls: type[BaseHook]) -> str | None:
    """Whether ``cls`` defines an ``on_*`` method that is no hook method (a typo never called), with the closest one."""
    for name in dir(cls):
        if name.startswith("on_") and name not in HOOK_METHODS and callable(getattr(cls, name)):
            close = difflib.get_close_matches(name, sorted(HOOK_METHODS), n=1)
            hint = f"; did you mean {close[0]}?" if close else f"; hook methods are {', '.join(sorted(HOOK_METHODS))}"
            return f"{cls.__name__}.{name} is not a hook method, so it would never be called{hint}"
    return None
