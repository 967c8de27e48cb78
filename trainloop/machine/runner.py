"""The runner of the transition table.

``transitions`` for the edges somebody listens to, a fast path that runs the same actions and sets the same states for
the others.

A ``transitions`` trigger costs about 20 µs and the hot edges fire on every microstep, so an edge
that no callback listens to (no entry or exit callback on its states, none on the edge) takes the
fast path; a test compares traces both ways.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from transitions import Machine
from transitions import State as _LibraryState

from trainloop.machine.diagram import draw
from trainloop.machine.table import FAIL, TRANSITIONS, State, Transition

if TYPE_CHECKING:
    from trainloop.machine.trace import Trace

__all__ = ["Handle", "StateMachine"]

# ``transitions`` logs every callback at INFO; keep it quiet unless the user configured it.
_transitions_logger = logging.getLogger("transitions")
if _transitions_logger.level == logging.NOTSET:
    _transitions_logger.setLevel(logging.WARNING)


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
    """A ``transitions`` state that runs the entering edge's action before its entry callbacks, as the fast path does.

    Both paths are then one machine.
    """

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
        self._trace: Trace | None = None
        self._edge_watchers: tuple[Callable[[Any, Transition], Any], ...] = ()
        self._observed = False  # a trace or an edge watcher: every edge leaves the fast path

    @property
    def trace(self) -> Trace | None:
        """Where fired edges are recorded, or ``None``."""
        return self._trace

    @trace.setter
    def trace(self, trace: Trace | None) -> None:
        self._trace = trace
        self._observed = trace is not None or bool(self._edge_watchers)

    @property
    def state(self) -> State:
        """The current state."""
        return self.model.state

    # -- running -------------------------------------------------------------------------------

    def advance(self) -> State:
        """Fire the first edge out of the current state whose condition holds."""
        for transition, condition, action, listened in self._edges[self.model.state]:
            if condition is None or condition():
                if listened or self._observed:
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
            try:
                self._fire(fail, None, self._is_listened(fail))
            finally:  # in exiting even when a callback on the way raised
                self.model.state = State.EXITING

    def _fire(self, transition: Transition, action: Callable[[], None] | None, listened: bool) -> None:
        if self._trace is not None:
            # Recorded first: the time the action and the entry callbacks take (a save, a load)
            # is the new state's; the step is the one the edge leaves.
            self._trace.record(transition, self._step())
        for watch in self._edge_watchers:  # likewise: what follows is the new state's work
            watch(self._owner, transition)
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

    def on_edge(self, fn: Callable[[Any, Transition], Any]) -> Handle:
        """Call ``fn(owner, transition)`` as each edge fires, self-loops included, before anything it does.

        ``fn`` runs where the trace records the edge: before the source's exit callbacks, the
        edge's action and the destination's entry callbacks, so everything from one call to the
        next is the work of the state entered (what a profiler range around each state needs).
        While any ``fn`` is attached every edge leaves the fast path; ``Handle.remove`` restores it.
        """
        try:  # checked now, like the other callbacks, so a wrong one fails at registration
            inspect.signature(fn).bind(self._owner, None)
        except TypeError as error:
            raise TypeError(f"edge watcher {fn!r} must accept two arguments (trainer, transition): {error}") from None
        except ValueError:  # some builtins have no signature; let them be
            pass
        self._edge_watchers += (fn,)
        self._observed = True

        def remove() -> None:
            watchers = list(self._edge_watchers)
            watchers.remove(fn)
            self._edge_watchers = tuple(watchers)
            self._observed = self._trace is not None or bool(watchers)

        return Handle(remove)

    def listens(self, state: State) -> bool:
        """Whether a callback waits for ``state`` to be entered."""
        return bool(self._machine.get_state(state).on_enter)

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
        """Draw the machine from its table: ``"mermaid"`` or ``"dot"`` (Graphviz) source text, or ``"svg"``."""
        return draw(self.table, format)
