"""The training state machine: its states, its transition table, and the runner around it.

The table ``TRANSITIONS`` is the single description of the loop. Rows that leave the same
state are tried top to bottom; the first whose condition holds fires. The ``transitions``
library runs an edge whenever a callback listens to it (a state's entry or exit, or the edge
itself); edges nobody listens to take a fast path that only sets the state, because a
``transitions`` trigger costs about 20 µs and the hot edges fire on every microstep.
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
    STEPPING = "stepping"
    """The first microstep of a step: data, forward, backward."""
    ACCUMULATING = "accumulating"
    """Each further microstep of the same step."""
    RETRYING = "retrying"
    """Gradients were non-finite: zero them and reset the step's records."""
    CHECKPOINTING = "checkpointing"
    """A save is due; hooks write it."""
    EXITING = "exiting"
    """``on_after_train``, data iterator closed. Final."""

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Transition:
    """One row of the transition table.

    Attributes:
        trigger: The event's name, as it appears in traces and diagrams.
        source: The state the edge leaves.
        dest: The state the edge enters.
        condition: Name of the policy that must hold for the edge to fire (a key of the
            ``conditions`` mapping given to ``StateMachine``); ``None`` always holds.
    """

    trigger: str
    source: State
    dest: State
    condition: str | None = None


_S = State
_MICROSTEP = (_S.STEPPING, _S.ACCUMULATING)

#: The loop, readable top to bottom. Per source state, rows are tried in this order.
TRANSITIONS: tuple[Transition, ...] = (
    Transition("start", _S.IDLE, _S.BUILDING),
    Transition("restore", _S.BUILDING, _S.RESTORING),
    Transition("finish", _S.RESTORING, _S.EXITING, "should_exit"),
    Transition("begin_step", _S.RESTORING, _S.STEPPING),
    *(Transition("accumulate", s, _S.ACCUMULATING, "microsteps_remain") for s in _MICROSTEP),
    *(Transition("retry", s, _S.RETRYING, "grads_non_finite") for s in _MICROSTEP),
    *(Transition("checkpoint", s, _S.CHECKPOINTING, "checkpoint_due") for s in _MICROSTEP),
    *(Transition("finish", s, _S.EXITING, "should_exit") for s in _MICROSTEP),
    *(Transition("begin_step", s, _S.STEPPING) for s in _MICROSTEP),
    Transition("begin_step", _S.RETRYING, _S.STEPPING),
    Transition("finish", _S.CHECKPOINTING, _S.EXITING, "should_exit"),
    Transition("begin_step", _S.CHECKPOINTING, _S.STEPPING),
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


class StateMachine:
    """Runs ``TRANSITIONS`` for one trainer.

    Args:
        conditions: The policies named in the table, each a zero-argument callable.
        owner: The object passed to callbacks (the trainer).
        step: Reads the current step number, for traces.
    """

    def __init__(
        self,
        conditions: Mapping[str, Callable[[], bool]],
        owner: Any,
        step: Callable[[], int],
        transitions: Iterable[Transition] = TRANSITIONS,
    ) -> None:
        self.table = tuple(transitions)
        missing = {t.condition for t in self.table if t.condition} - set(conditions)
        if missing:
            raise ValueError(f"no policy given for conditions {sorted(missing)}")
        self._owner = owner
        self._step = step
        self.model = _Model()
        self._machine = Machine(
            model=self.model,
            states=State,
            initial=State.IDLE,
            transitions=[
                {"trigger": t.trigger, "source": t.source, "dest": t.dest} for t in self.table
            ],
            auto_transitions=False,
            queued=True,
        )
        self._conditions = conditions
        # Per source state: (row, its policy, whether a callback listens), in table order.
        self._edges: dict[State, list[tuple[Transition, Callable[[], bool] | None, bool]]] = {}
        self._refresh_listened()
        self.trace: Trace | None = None

    @property
    def state(self) -> State:
        """The current state."""
        return self.model.state

    # -- running -------------------------------------------------------------------------------

    def advance(self) -> State:
        """Fire the first edge out of the current state whose condition holds."""
        for transition, condition, listened in self._edges[self.model.state]:
            if condition is None or condition():
                self._fire(transition, listened)
                return transition.dest
        raise RuntimeError(f"no transition leaves state {self.model.state.value!r}")

    def fail(self) -> None:
        """Move to ``exiting`` because of an error; does nothing if already there."""
        if self.model.state is not State.EXITING:
            fail = next(t for t in self.table if t.trigger == FAIL and t.source is self.state)
            self._fire(fail, self._is_listened(fail))

    def _fire(self, transition: Transition, listened: bool) -> None:
        if self.trace is not None:
            # Recorded first: the time the entry callbacks take (a save, a load) is the new state's.
            self.trace.record(transition, self._step())
        if listened:
            self._machine.events[transition.trigger].trigger(self.model)
        else:
            self.model.state = transition.dest

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
        edges: dict[State, list[tuple[Transition, Callable[[], bool] | None, bool]]] = {s: [] for s in State}
        for t in self.table:
            if t.trigger != FAIL:
                condition = self._conditions[t.condition] if t.condition else None
                edges[t.source].append((t, condition, self._is_listened(t)))
        self._edges = edges

    # -- drawing -------------------------------------------------------------------------------

    def diagram(self, format: str = "mermaid") -> str:
        """Draw the machine from its table: ``"mermaid"`` or ``"dot"`` (Graphviz) source text."""
        return draw(self.table, format)


# Edges into these states are rare and telling: coloured in a drawing of a run that took them.
_RARE_EDGE_COLORS = {State.RETRYING: "darkorange", State.CHECKPOINTING: "royalblue"}


def _label(t: Transition) -> str:
    return f"{t.trigger} [{t.condition}]" if t.condition else t.trigger


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
