import pytest
import torch

from trainloop import BaseHook, State
from trainloop.machine import TRANSITIONS, StateMachine, Transition, draw


class Policies:
    """Settable answers for the table's conditions."""

    def __init__(self):
        self.values = {
            "should_exit": False, "microsteps_remain": False, "grads_non_finite": False, "validation_due": False,
            "checkpoint_due": False, "predicting_run": False, "updates_remain": False,
        }
        self.step = 0

    def conditions(self):
        return {name: (lambda name=name: self.values[name]) for name in self.values}


    def actions(self):
        def begin_step():
            self.step += 1
            self.done.append(("begin_step", self.step))

        return {
            "begin_step": begin_step,
            "next_update": lambda: self.done.append(("next_update", self.step)),
            "redo_step": lambda: self.done.append(("redo_step", self.step)),
        }


def make_machine(policies=None):
    policies = policies or Policies()
    policies.done = []
    owner = object()
    machine = StateMachine(policies.conditions(), owner=owner, step=lambda: policies.step, actions=policies.actions())
    return machine, policies, owner


def test_state_is_a_str_enum_with_the_seven_states():
    names = {"building", "restoring", "stepping", "accumulating", "retrying", "checkpointing", "exiting"}
    assert names <= {s.value for s in State}
    assert State("stepping") is State.STEPPING
    assert State.STEPPING == "stepping"
    assert isinstance(State.EXITING, str)


def test_table_reaches_every_state_and_exiting_is_final():
    reachable, frontier = {State.IDLE}, [State.IDLE]
    while frontier:
        source = frontier.pop()
        for t in TRANSITIONS:
            if t.source is source and t.dest not in reachable:
                reachable.add(t.dest)
                frontier.append(t.dest)
    assert reachable == set(State)
    assert not [t for t in TRANSITIONS if t.source is State.EXITING]
    # Every running state can fail into exiting.
    assert {t.source for t in TRANSITIONS if t.trigger == "fail"} == set(State) - {State.IDLE, State.EXITING}


def test_policies_pick_the_edge_in_table_order_and_actions_run_on_their_edges():
    machine, p, _ = make_machine()
    assert [machine.advance() for _ in range(3)] == [State.BUILDING, State.RESTORING, State.ACCUMULATING]
    assert p.done == [("begin_step", 1)]
    p.values["microsteps_remain"] = True
    assert machine.advance() is State.ACCUMULATING
    p.values["microsteps_remain"] = False
    assert machine.advance() is State.STEPPING
    p.values.update(grads_non_finite=True, checkpoint_due=True, should_exit=True)
    assert machine.advance() is State.RETRYING  # a retry is decided before a save or an exit
    assert machine.advance() is State.ACCUMULATING
    assert p.done == [("begin_step", 1), ("redo_step", 1)]  # a redone step is not counted
    assert machine.advance() is State.STEPPING
    p.values.update(grads_non_finite=False, validation_due=True)
    assert machine.advance() is State.VALIDATING  # a due validation comes before a save: keep-best sees it
    assert machine.advance() is State.CHECKPOINTING  # a due save comes before exit
    assert machine.advance() is State.EXITING
    with pytest.raises(RuntimeError, match="no transition leaves state 'exiting'"):
        machine.advance()


def test_every_decision_after_an_update_leaves_from_stepping():
    decisions = {t.dest for t in TRANSITIONS if t.source is State.STEPPING and t.trigger != "fail"}
    assert decisions == {State.RETRYING, State.VALIDATING, State.CHECKPOINTING, State.EXITING, State.ACCUMULATING}
    after_validating = [(t.dest, t.condition) for t in TRANSITIONS if t.source is State.VALIDATING and t.trigger != "fail"]
    assert after_validating == [
        (State.CHECKPOINTING, "checkpoint_due"), (State.EXITING, "should_exit"), (State.ACCUMULATING, None)
    ]
    # accumulating only loops or goes to the update; nothing else decides there.
    assert {(t.dest, t.condition) for t in TRANSITIONS if t.source is State.ACCUMULATING and t.trigger != "fail"} == {
        (State.ACCUMULATING, "microsteps_remain"), (State.STEPPING, None)
    }
    assert {t.action for t in TRANSITIONS if t.dest is State.ACCUMULATING} == {"begin_step", "redo_step", "next_update", None}


def test_validating_at_the_start_then_the_first_step_or_the_end():
    machine, p, _ = make_machine()
    machine.advance(), machine.advance()
    p.values["validation_due"] = True
    assert machine.advance() is State.VALIDATING  # restoring -> validating (at_start, or an evaluate run)
    p.values["validation_due"] = False
    assert machine.advance() is State.ACCUMULATING
    assert p.done == [("begin_step", 1)]  # the first step begins on the edge out of validating
    machine, p, _ = make_machine()
    machine.advance(), machine.advance()
    p.values.update(validation_due=True)
    machine.advance()
    p.values.update(validation_due=False, should_exit=True)
    assert machine.advance() is State.EXITING  # an evaluate run: building, restoring, validating, exiting
    assert p.done == []


def test_a_predict_run_goes_from_restoring_through_predicting_to_exiting():
    machine, p, _ = make_machine()
    machine.advance(), machine.advance()
    p.values["predicting_run"] = True
    assert machine.advance() is State.PREDICTING
    assert machine.advance() is State.EXITING  # unconditionally: the run's one pass is done
    assert p.done == []  # no step begun


def test_restoring_at_max_steps_goes_straight_to_exiting():
    machine, p, _ = make_machine()
    machine.advance(), machine.advance()
    p.values["should_exit"] = True
    assert machine.advance() is State.EXITING


def test_fail_moves_any_running_state_to_exiting_once():
    machine, _, _ = make_machine()
    machine.trace = __import__("trainloop.machine", fromlist=["Trace"]).Trace()
    machine.advance()
    machine.fail()
    machine.fail()
    assert machine.state is State.EXITING
    assert [(e.source, e.dest, e.trigger) for e in machine.trace] == [
        (State.IDLE, State.BUILDING, "start"),
        (State.BUILDING, State.EXITING, "fail"),
    ]


def test_callbacks_fire_through_transitions_and_can_be_removed():
    machine, p, owner = make_machine()
    seen = []
    enter = machine.on_enter("accumulating", lambda o: seen.append(("enter", p.step, o is owner)))
    machine.on_exit(State.RESTORING, lambda o: seen.append(("exit restoring", p.step, o is owner)))
    machine.on_transition("stepping", "accumulating", lambda o: seen.append(("stepping->accumulating", p.step, o is owner)))
    for _ in range(5):  # building, restoring, accumulating, stepping, accumulating
        machine.advance()
    assert seen == [
        ("exit restoring", 0, True),
        ("enter", 1, True),  # after the edge's action: the step is already counted
        ("enter", 2, True),
        ("stepping->accumulating", 2, True),
    ]
    enter.remove()
    enter.remove()  # a second remove does nothing
    seen.clear()
    machine.advance(), machine.advance()
    assert seen == [("stepping->accumulating", 3, True)]


def test_fast_path_is_taken_only_for_edges_nobody_listens_to():
    machine, _, _ = make_machine()
    edges = lambda: {t.dest: listened for t, _, _, listened in machine._edges[State.STEPPING]}  # noqa: E731
    assert not any(edges().values())
    handle = machine.on_enter(State.RETRYING, lambda o: None)
    assert edges()[State.RETRYING]
    assert not edges()[State.ACCUMULATING]
    handle.remove()
    assert not any(edges().values())


@pytest.mark.parametrize("listened", [False, True])
def test_an_edge_action_runs_once_on_either_path(listened):
    machine, p, _ = make_machine()
    if listened:
        machine.on_transition(State.RESTORING, State.ACCUMULATING, lambda o: None)
    for _ in range(3):
        machine.advance()
    assert p.done == [("begin_step", 1)]


def test_callback_signature_is_checked_at_registration():
    machine, _, _ = make_machine()
    with pytest.raises(TypeError, match="must accept one argument"):
        machine.on_enter(State.STEPPING, lambda: None)
    with pytest.raises(ValueError, match="'nowhere' is not a valid State"):
        machine.on_enter("nowhere", lambda o: None)
    with pytest.raises(ValueError, match="no transition from 'idle' to 'stepping'"):
        machine.on_transition(State.IDLE, State.STEPPING, lambda o: None)
    with pytest.raises(ValueError, match="no transition from 'accumulating' to 'retrying'"):
        machine.on_transition(State.ACCUMULATING, State.RETRYING, lambda o: None)


def test_a_table_naming_an_unknown_policy_is_rejected():
    with pytest.raises(ValueError, match=r"no callable given for conditions \['mystery'\]"):
        StateMachine({}, owner=None, step=lambda: 0, transitions=[Transition("x", State.IDLE, State.BUILDING, "mystery")])
    with pytest.raises(ValueError, match=r"no callable given for actions \['tidy'\]"):
        StateMachine({}, owner=None, step=lambda: 0, transitions=[Transition("x", State.IDLE, State.BUILDING, action="tidy")])


def test_trace_records_the_step_each_edge_leaves():
    machine, p, _ = make_machine()
    machine.trace = __import__("trainloop.machine", fromlist=["Trace"]).Trace()
    for _ in range(5):
        machine.advance()
    assert [(e.step, e.dest, e.trigger) for e in machine.trace] == [
        (0, State.BUILDING, "start"), (0, State.RESTORING, "restore"), (0, State.ACCUMULATING, "begin_step"),
        (1, State.STEPPING, "update"), (1, State.ACCUMULATING, "begin_step"),
    ]
    assert machine.trace.counts()[(State.STEPPING, State.ACCUMULATING, "begin_step")] == 1


def test_mermaid_and_dot_are_drawn_from_the_table():
    mermaid = draw(format="mermaid")
    dot = draw(format="dot")
    assert mermaid.startswith("stateDiagram-v2\n")
    assert dot.startswith("digraph trainloop {")
    for t in TRANSITIONS:
        label = f"{t.trigger} [{t.condition}]" if t.condition else t.trigger
        label += f" / {t.action}()" if t.action else ""
        assert f"{t.source.value} --> {t.dest.value}: {label}" in mermaid
        assert f'"{t.source.value}" -> "{t.dest.value}" [label="{label}"' in dot
    assert len(mermaid.splitlines()) == len(TRANSITIONS) + 3
    with pytest.raises(ValueError, match="unknown diagram format 'png'; use 'mermaid', 'dot' or 'svg'"):
        draw(format="png")


def scripted_run(listen_everywhere):
    """Accumulation, a retry, a checkpoint and an exit request, with or without callbacks."""
    from helper_hooks import ExitAt
    from tiny_trainer import FlakyTrainer

    class SaveAtThree(BaseHook):
        def on_after_step(self, trainer):
            if trainer.step == 3:
                trainer.request_checkpoint()

    trainer = FlakyTrainer(max_steps=10, gradient_accumulation_steps=2, max_non_finite_grad_retries=2,
                           nan_at={5}, hooks=[SaveAtThree(), ExitAt(5)], trace=True)
    heard = []
    if listen_everywhere:
        for source, dest in {(t.source, t.dest) for t in TRANSITIONS}:
            trainer.on_transition(source, dest, lambda t, edge=(source, dest): heard.append(edge))
        for state in State:
            trainer.on_enter(state, lambda t: None)
            trainer.on_exit(state, lambda t: None)
        assert all(listened for edges in trainer._machine._edges.values() for *_, listened in edges)
    else:
        assert not any(listened for edges in trainer._machine._edges.values() for *_, listened in edges)
    trainer.train()
    trace = [(e.step, e.source, e.dest, e.trigger) for e in trainer.trace]
    return trainer, trace, heard


def test_the_fast_path_and_transitions_run_the_same_machine():
    fast, fast_trace, _ = scripted_run(listen_everywhere=False)
    slow, slow_trace, heard = scripted_run(listen_everywhere=True)
    assert fast_trace == slow_trace
    assert heard == [(source, dest) for _, source, dest, _ in slow_trace]  # every edge, in order
    triggers = {trigger for *_, trigger in fast_trace}
    assert {"accumulate", "update", "retry", "redo_step", "checkpoint", "begin_step", "finish"} <= triggers
    assert fast.step == slow.step == 5
    for a, b in zip(fast.model.parameters(), slow.model.parameters()):
        assert torch.equal(a, b)


def test_an_error_in_a_state_callback_shows_the_users_frames_not_the_state_machine_library():
    import traceback
    from pathlib import Path

    import transitions
    from tiny_trainer import TinyTrainer

    class Refuses(BaseHook):
        def on_after_step(self, trainer):
            trainer.request_checkpoint()

        def on_enter_checkpointing(self, trainer):
            raise ValueError("no room for a checkpoint")

    trainer = TinyTrainer(max_steps=3, hooks=[Refuses()])
    with pytest.raises(ValueError, match="no room for a checkpoint") as caught:
        trainer.train()
    frames = traceback.extract_tb(caught.value.__traceback__)
    library = str(Path(transitions.__file__).parent)
    assert [f for f in frames if f.filename.startswith(library)] == []
    # The test's call, trainloop's entry to the run, then the hook: not the loop's ~25 frames in between.
    assert [f.name for f in frames] == [
        "test_an_error_in_a_state_callback_shows_the_users_frames_not_the_state_machine_library",
        "train", "_run_machine", "on_enter_checkpointing",
    ]
    assert frames[-1].filename == __file__
