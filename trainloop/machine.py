"""The training state machine: its states, its transition table, and the runner around it.

The table ``TRANSITIONS`` is the single description of the loop. Rows that leave the same
state are tried top to bottom; the first whose condition holds fires, and runs the row's
action (if any) on the way. The ``transitions`` library runs an edge whenever a callback
listens to it (a state's entry or exit, or the edge itself); edges nobody listens to take a fast
path that runs the same action and sets the state, because a ``transitions`` trigger costs about
20 µs and the hot edges fire on every microstep.
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

from transitions import Machine
from transitions import State as _LibraryState

if TYPE_CHECKING:
    from .trace import Trace

__all__ = ["Handle", "State", "StateMachine", "Transition", "TRANSITIONS", "draw"]

# ``transitions`` logs every callback at INFO; keep it quiet unless the user configured it.
_transitions_logger = logging.getLogger("transitions")
if _transitions_logger.level == logging.NOTSET:
    _transitions_logger.setLevel(logging.WARNING)


class State(str, Enum):
    """The states of a training run."""

    IDLE = "idle"
    """Constructed, ``train()`` not called yet."""
    BUILDING = "building"
    """Building data loader, model, optimizer, lr scheduler, grad scaler and hooks."""
    RESTORING = "restoring"
    """Loading a checkpoint (if a hook does), then ``on_before_train``."""
    ACCUMULATING = "accumulating"
    """One microstep: draw a batch, ``forward``, backward. Entered for every microstep of a
    step, the first included (also without accumulation)."""
    STEPPING = "stepping"
    """The optimizer update of a step: unscale, ``Loss`` normalisation, clipping, the
    non-finite check, optimizer and scheduler step, ``on_after_step``."""
    RETRYING = "retrying"
    """The update found non-finite gradients (fp16's skipped updates included): zero them,
    reset the step's records, count the retry."""
    CHECKPOINTING = "checkpointing"
    """A save is due; hooks write it."""
    EXITING = "exiting"
    """``on_after_train``, data iterator closed. Final."""

    def __str__(self) -> str:
        return self.value

    # str's own hash, in C: Enum's is a Python call (the loop looks states up in dicts every
    # microstep), and it agrees with ``==``, which compares the string value.
    __hash__ = str.__hash__


@dataclass(frozen=True)
class Transition:
    """One row of the transition table.

    Attributes:
        trigger: The event's name, as it appears in traces and diagrams.
        source: The state the edge leaves.
        dest: The state the edge enters.
        condition: Name of the policy that must hold for the edge to fire (a key of the
            ``conditions`` mapping given to ``StateMachine``); ``None`` always holds.
        action: Name of the bookkeeping the edge does when it fires (a key of the ``actions``
            mapping given to ``StateMachine``). It runs once the machine is in ``dest``, before
            ``dest``'s entry callbacks: they see what it did. ``None``: nothing.
    """

    trigger: str
    source: State
    dest: State
    condition: str | None = None
    action: str | None = None


_S = State

#: The loop, readable top to bottom. Per source state, rows are tried in this order. Every
#: decision about what follows an optimizer update leaves from ``stepping``.
TRANSITIONS: tuple[Transition, ...] = (
    Transition("start", _S.IDLE, _S.BUILDING),
    Transition("restore", _S.BUILDING, _S.RESTORING),
    Transition("finish", _S.RESTORING, _S.EXITING, "should_exit"),
    Transition("begin_step", _S.RESTORING, _S.ACCUMULATING, action="begin_step"),
    Transition("accumulate", _S.ACCUMULATING, _S.ACCUMULATING, "microsteps_remain"),
    Transition("update", _S.ACCUMULATING, _S.STEPPING),
    Transition("retry", _S.STEPPING, _S.RETRYING, "grads_non_finite"),
    Transition("checkpoint", _S.STEPPING, _S.CHECKPOINTING, "checkpoint_due"),
    Transition("finish", _S.STEPPING, _S.EXITING, "should_exit"),
    Transition("begin_step", _S.STEPPING, _S.ACCUMULATING, action="begin_step"),
    Transition("redo_step", _S.RETRYING, _S.ACCUMULATING, action="redo_step"),
    Transition("finish", _S.CHECKPOINTING, _S.EXITING, "should_exit"),
    Transition("begin_step", _S.CHECKPOINTING, _S.ACCUMULATING, action="begin_step"),
    # An error (or an interrupt) anywhere ends the run through ``exiting``.
    *(Transition("fail", s, _S.EXITING) for s in _S if s not in (_S.IDLE, _S.EXITING)),
)

FAIL = "fail"


class Handle:
    """Returned by callback registration; ``remove`` detaches the callback again."""

    def __init__(self, remove: Callable[[], None]) -> None:
        self._remove: Callable[[], None] | None = remove

    def remove(self) -> None:
        """Detach the callback (a second call does nothing)."""
        if self._remove is not None:
            self._remove()
            self._remove = None


class _Model:
    """The object ``transitions`` drives; it holds nothing but the state.

    A dedicated model keeps trigger names from colliding with trainer attributes (``transitions``
    silently skips binding a trigger whose name is taken).
    """

    state: State


class _ActingState(_LibraryState):
    """A ``transitions`` state that runs the entering edge's action before its entry callbacks,
    as the fast path does: both paths are then one machine."""

    def enter(self, event_data: Any) -> None:
        action = getattr(event_data.transition, "action", None)
        if action is not None:
            action()
        super().enter(event_data)


class _Machine(Machine):
    state_cls = _ActingState


_Edge = tuple[Transition, Callable[[], bool] | None, Callable[[], None] | None, bool]


class StateMachine:
    """Runs ``TRANSITIONS`` for one trainer.

    Args:
        conditions: The policies named in the table, each a zero-argument callable.
        owner: The object passed to callbacks (the trainer).
        step: Reads the current step number, for traces.
        actions: The edges' bookkeeping named in the table, each a zero-argument callable.
        transitions: The table to run.
    """

    def __init__(
        self,
        conditions: Mapping[str, Callable[[], bool]],
        owner: Any,
        step: Callable[[], int],
        actions: Mapping[str, Callable[[], None]] | None = None,
        transitions: Iterable[Transition] = TRANSITIONS,
    ) -> None:
        self.table = tuple(transitions)
        actions = dict(actions or {})
        for kind, given, named in (
            ("conditions", conditions, {t.condition for t in self.table if t.condition}),
            ("actions", actions, {t.action for t in self.table if t.action}),
        ):
            if named - set(given):
                raise ValueError(f"no callable given for {kind} {sorted(named - set(given))}")
        self._owner = owner
        self._step = step
        self.model = _Model()
        self._machine = _Machine(
            model=self.model,
            states=State,
            initial=State.IDLE,
            transitions=[
                {"trigger": t.trigger, "source": t.source, "dest": t.dest} for t in self.table
            ],
            auto_transitions=False,
            queued=True,
        )
        for t in self.table:
            if t.action:
                # (trigger, source) is unique in the table, so each library edge is one row.
                for edge in self._machine.get_transitions(trigger=t.trigger, source=t.source, dest=t.dest):
                    edge.action = actions[t.action]  # type: ignore[attr-defined]
        self._conditions = conditions
        self._actions = actions
        # Per source state: (row, its policy, its action, whether a callback listens), in order.
        self._edges: dict[State, list[_Edge]] = {}
        self._refresh_listened()
        self.trace: Trace | None = None

    @property
    def state(self) -> State:
        """The current state."""
        return self.model.state

    # -- running -------------------------------------------------------------------------------

    def advance(self) -> State:
        """Fire the first edge out of the current state whose condition holds."""
        for transition, condition, action, listened in self._edges[self.model.state]:
            if condition is None or condition():
                if listened or self.trace is not None:
                    self._fire(transition, action, listened)
                else:  # the fast path, inlined: this runs on every microstep
                    self.model.state = transition.dest
                    if action is not None:
                        action()
                return transition.dest
        raise RuntimeError(f"no transition leaves state {self.model.state.value!r}")

    def fail(self) -> None:
        """Move to ``exiting`` because of an error; does nothing if already there."""
        if self.model.state is not State.EXITING:
            fail = next(t for t in self.table if t.trigger == FAIL and t.source is self.state)
            self._fire(fail, None, self._is_listened(fail))

    def _fire(self, transition: Transition, action: Callable[[], None] | None, listened: bool) -> None:
        if self.trace is not None:
            # Recorded first: the time the action and the entry callbacks take (a save, a load)
            # is the new state's; the step is the one the edge leaves.
            self.trace.record(transition, self._step())
        if listened:
            self._machine.events[transition.trigger].trigger(self.model)  # runs the action too
        else:
            self.model.state = transition.dest
            if action is not None:
                action()

    # -- callbacks -----------------------------------------------------------------------------

    def on_enter(self, state: State | str, fn: Callable[[Any], Any]) -> Handle:
        """Call ``fn(owner)`` each time ``state`` is entered."""
        return self._add_state_callback(State(state), "enter", fn)

    def on_exit(self, state: State | str, fn: Callable[[Any], Any]) -> Handle:
        """Call ``fn(owner)`` each time ``state`` is left."""
        return self._add_state_callback(State(state), "exit", fn)

    def on_transition(
        self, source: State | str, dest: State | str, fn: Callable[[Any], Any]
    ) -> Handle:
        """Call ``fn(owner)`` each time an edge from ``source`` to ``dest`` fires."""
        source, dest = State(source), State(dest)
        targets = self._machine.get_transitions(source=source, dest=dest)
        if not targets:
            raise ValueError(f"the machine has no transition from {source.value!r} to {dest.value!r}")
        callback = self._callback(fn)
        for t in targets:
            t.add_callback("after", callback)

        def remove() -> None:
            for t in targets:
                t.after.remove(callback)
            self._refresh_listened()

        self._refresh_listened()
        return Handle(remove)

    def _add_state_callback(self, state: State, kind: str, fn: Callable[[Any], Any]) -> Handle:
        target = self._machine.get_state(state)
        callback = self._callback(fn)
        target.add_callback(kind, callback)

        def remove() -> None:
            getattr(target, f"on_{kind}").remove(callback)
            self._refresh_listened()

        self._refresh_listened()
        return Handle(remove)

    def _callback(self, fn: Callable[[Any], Any]) -> Callable[..., Any]:
        # Check the signature now, so a wrong callback fails at registration, not mid-run.
        try:
            inspect.signature(fn).bind(self._owner)
        except TypeError as error:
            raise TypeError(f"callback {fn!r} must accept one argument (the trainer): {error}") from None
        except ValueError:  # some builtins have no signature; let them be
            pass
        owner = self._owner

        def callback(*_: Any, **__: Any) -> None:
            fn(owner)

        return callback

    def _is_listened(self, t: Transition) -> bool:
        """Whether a callback waits on this edge (read from ``transitions``' own lists)."""
        source, dest = self._machine.get_state(t.source), self._machine.get_state(t.dest)
        edges = self._machine.get_transitions(trigger=t.trigger, source=t.source, dest=t.dest)
        return bool(source.on_exit or dest.on_enter or any(e.before or e.after or e.prepare for e in edges))

    def _refresh_listened(self) -> None:
        """Rebuild the per-state edge lists after callbacks were added or removed."""
        edges: dict[State, list[_Edge]] = {s: [] for s in State}
        for t in self.table:
            if t.trigger != FAIL:
                condition = self._conditions[t.condition] if t.condition else None
                action = self._actions[t.action] if t.action else None
                edges[t.source].append((t, condition, action, self._is_listened(t)))
        self._edges = edges

    # -- drawing -------------------------------------------------------------------------------

    def diagram(self, format: str = "mermaid") -> str:
        """Draw the machine from its table: ``"mermaid"`` or ``"dot"`` (Graphviz) source text."""
        return draw(self.table, format)


# Edges into these states are rare and telling: coloured in a drawing of a run that took them.
_RARE_EDGE_COLORS = {State.RETRYING: "darkorange", State.CHECKPOINTING: "royalblue"}


def _label(t: Transition) -> str:
    """``trigger``, then ``[condition]`` and ``/ action()`` when the row has them."""
    label = f"{t.trigger} [{t.condition}]" if t.condition else t.trigger
    return f"{label} / {t.action}()" if t.action else label


def draw(
    table: Iterable[Transition] = TRANSITIONS,
    format: str = "mermaid",
    counts: Mapping[tuple[State, State, str], int] | None = None,
) -> str:
    """Render a transition table as Mermaid ``stateDiagram-v2`` or Graphviz DOT source.

    Args:
        table: The transitions to draw.
        format: ``"mermaid"`` or ``"dot"``.
        counts: How often each edge ``(source, dest, trigger)`` fired in a run (e.g.
            ``summarize_trace(...).counts``). Each edge's label then ends with ``(n=<count>)``;
            in DOT the line's width grows with the count, an edge that never fired is grey and
            dashed, and fired edges into ``retrying``, ``checkpointing`` (and ``fail``) are coloured.

    Raises:
        ValueError: ``format`` is neither.
    """
    table = tuple(table)

    def label(t: Transition) -> str:
        return _label(t) if counts is None else f"{_label(t)} (n={counts.get((t.source, t.dest, t.trigger), 0)})"

    if format == "mermaid":
        lines = ["stateDiagram-v2", f"    [*] --> {State.IDLE.value}"]
        lines += [f"    {t.source.value} --> {t.dest.value}: {label(t)}" for t in table]
        lines.append(f"    {State.EXITING.value} --> [*]")
        return "\n".join(lines) + "\n"
    if format == "dot":
        lines = ["digraph trainloop {", "    rankdir=LR;", "    node [shape=box, style=rounded];"]
        lines.append(f'    "{State.EXITING.value}" [peripheries=2];')
        for t in table:
            attributes = [f'label="{label(t)}"']
            if t.trigger == FAIL:
                attributes.append("style=dashed")
            if counts is not None:
                fired = counts.get((t.source, t.dest, t.trigger), 0)
                if fired:
                    # Logarithmic: a per-microstep edge must not drown the rare ones (retries, saves).
                    attributes.append(f"penwidth={min(1.0 + 1.5 * math.log10(fired), 8.0):.2f}")
                    color = "red" if t.trigger == FAIL else _RARE_EDGE_COLORS.get(t.dest)
                    if color is not None:
                        attributes.append(f"color={color}, fontcolor={color}")
                else:
                    attributes.append("color=gray70, fontcolor=gray55" + ("" if t.trigger == FAIL else ", style=dashed"))
            lines.append(f'    "{t.source.value}" -> "{t.dest.value}" [{", ".join(attributes)}];')
        lines.append("}")
        return "\n".join(lines) + "\n"
    raise ValueError(f"unknown diagram format {format!r}; use 'mermaid' or 'dot'")
