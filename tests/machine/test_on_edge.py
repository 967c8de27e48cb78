"""``on_edge``: every edge, as it fires, before anything it does; removable (the profiler's ranges hang on it)."""

from __future__ import annotations

import pytest
from helper_hooks import ExitAt
from tiny_trainer import FlakyTrainer

from trainloop import BaseHook, State
from trainloop.machine import TRANSITIONS, StateMachine

CONDITIONS = {t.condition for t in TRANSITIONS if t.condition is not None}  # none holds: the plainest path


def test_every_edge_is_seen_before_its_action_and_the_entry_callbacks():
    done: list[object] = []
    step = [0]

    def begin_step():
        step[0] += 1
        done.append(("action", step[0]))

    conditions = {name: (lambda: False) for name in CONDITIONS}
    owner = object()
    machine = StateMachine(conditions, owner=owner, step=lambda: step[0], actions={"begin_step": begin_step, "next_update": lambda: None, "redo_step": lambda: None})
    machine.on_enter(State.ACCUMULATING, lambda o: done.append(("entered", step[0])))
    handle = machine.on_edge(lambda o, t: done.append((o is owner, t.trigger, t.dest.value, step[0])))
    for _ in range(4):
        machine.advance()
    assert done == [
        (True, "start", "building", 0),
        (True, "restore", "restoring", 0),
        (True, "begin_step", "accumulating", 0), ("action", 1), ("entered", 1),
        (True, "update", "stepping", 1),
    ]
    handle.remove()
    handle.remove()  # a second remove does nothing
    done.clear()
    machine.advance()
    assert done == [("action", 2), ("entered", 2)]


def test_a_watcher_that_cannot_take_trainer_and_transition_fails_at_registration():
    conditions = {name: (lambda: False) for name in CONDITIONS}
    machine = StateMachine(conditions, owner=None, step=lambda: 0, actions={"begin_step": lambda: None, "next_update": lambda: None, "redo_step": lambda: None})
    with pytest.raises(TypeError, match=r"must accept two arguments \(trainer, transition\)"):
        machine.on_edge(lambda trainer: None)
    machine.advance()  # nothing was attached
    assert machine.state is State.BUILDING


def test_a_watcher_may_remove_itself_while_it_is_called():
    conditions = {name: (lambda: False) for name in CONDITIONS}
    machine = StateMachine(conditions, owner=None, step=lambda: 0, actions={"begin_step": lambda: None, "next_update": lambda: None, "redo_step": lambda: None})
    seen: list[str] = []
    handles = []

    def once(owner, transition):
        seen.append(transition.trigger)
        handles[0].remove()

    handles.append(machine.on_edge(once))
    machine.on_edge(lambda o, t: seen.append("other:" + t.trigger))
    machine.advance()
    machine.advance()
    assert seen == ["start", "other:start", "other:restore"]


class SaveAtThree(BaseHook):
    def on_after_step(self, trainer):
        if trainer.step == 3:
            trainer.request_checkpoint()


def scripted(**settings):
    return FlakyTrainer(max_steps=10, gradient_accumulation_steps=2, max_non_finite_grad_retries=2, nan_at={5},
                        hooks=[SaveAtThree(), ExitAt(5)], **settings)


def test_a_trainer_shows_its_watcher_the_edges_its_trace_records():
    traced = scripted(trace=True)
    traced.train()
    watched = scripted()  # no trace: the edges leave the fast path only for the watcher
    seen = []
    watched.on_edge(lambda trainer, t: seen.append((trainer.step, t.source, t.dest, t.trigger)))
    watched.train()
    assert seen == [(e.step, e.source, e.dest, e.trigger) for e in traced.trace]
    assert {"accumulate", "update", "retry", "redo_step", "checkpoint", "begin_step", "finish"} <= {s[3] for s in seen}
