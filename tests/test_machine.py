import pytest

from trainloop import TRANSITIONS, State
from trainloop.machine import StateMachine, Transition, draw


class Policies:
    """Settable answers for the table's conditions."""

    def __init__(self):
        self.values = {"should_exit": False, "microsteps_remain": False, "grads_non_finite": False, "checkpoint_due": False}
        self.step = 0

    def conditions(self):
        return {name: (lambda name=name: self.values[name]) for name in self.values}


def make_machine(policies=None):
    policies = policies or Policies()
    owner = object()
    return StateMachine(policies.conditions(), owner=owner, step=lambda: policies.step), policies, owner


def test_state_is_a_str_enum_with_the_seven_states():
    names = {"building", "restoring", "stepping", "accumulating", "retrying", "checkpointing", "exiting"}
    assert names <= {s.value for s in State}
    assert State("stepping") is State.STEPPING and State.STEPPING == "stepping"
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


def test_policies_pick_the_edge_in_table_order():
    machine, p, _ = make_machine()
    assert [machine.advance() for _ in range(3)] == [State.BUILDING, State.RESTORING, State.STEPPING]
    p.values.update(microsteps_remain=True, grads_non_finite=True)
    assert machine.advance() is State.ACCUMULATING  # accumulation is tried before retry
    p.values["microsteps_remain"] = False
    assert machine.advance() is State.RETRYING
    assert machine.advance() is State.STEPPING
    p.values.update(grads_non_finite=False, checkpoint_due=True, should_exit=True)
    assert machine.advance() is State.CHECKPOINTING  # a due save comes before exit
    assert machine.advance() is State.EXITING
    with pytest.raises(RuntimeError, match="no transition leaves state 'exiting'"):
        machine.advance()


def test_restoring_at_max_steps_goes_straight_to_exiting():
    machine, p, _ = make_machine()
    machine.advance(), machine.advance()
    p.values["should_exit"] = True
    assert machine.advance() is State.EXITING


def test_fail_moves_any_running_state_to_exiting_once():
    machine, _, _ = make_machine()
    machine.trace = __import__("trainloop").Trace()
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
    enter = machine.on_enter("stepping", lambda o: seen.append(("enter", o is owner)))
    machine.on_exit(State.RESTORING, lambda o: seen.append(("exit restoring", o is owner)))
    machine.on_transition("stepping", "stepping", lambda o: seen.append(("stepping->stepping", o is owner)))
    for _ in range(4):
        machine.advance()
    assert seen == [
        ("exit restoring", True),
        ("enter", True),
        ("enter", True),
        ("stepping->stepping", True),
    ]
    enter.remove()
    enter.remove()  # a second remove does nothing
    seen.clear()
    machine.advance()
    assert seen == [("stepping->stepping", True)]


def test_fast_path_is_taken_only_for_edges_nobody_listens_to():
    machine, _, _ = make_machine()
    edges = lambda: {t.dest: listened for t, _, listened in machine._edges[State.STEPPING]}  # noqa: E731
    assert not any(edges().values())
    handle = machine.on_enter(State.RETRYING, lambda o: None)
    assert edges()[State.RETRYING] and not edges()[State.STEPPING]
    handle.remove()
    assert not any(edges().values())


def test_callback_signature_is_checked_at_registration():
    machine, _, _ = make_machine()
    with pytest.raises(TypeError, match="must accept one argument"):
        machine.on_enter(State.STEPPING, lambda: None)
    with pytest.raises(ValueError, match="'nowhere' is not a valid State"):
        machine.on_enter("nowhere", lambda o: None)
    with pytest.raises(ValueError, match="no transition from 'idle' to 'stepping'"):
        machine.on_transition(State.IDLE, State.STEPPING, lambda o: None)


def test_a_table_naming_an_unknown_policy_is_rejected():
    with pytest.raises(ValueError, match=r"no policy given for conditions \['mystery'\]"):
        StateMachine({}, owner=None, step=lambda: 0, transitions=[Transition("x", State.IDLE, State.BUILDING, "mystery")])


def test_trace_records_step_numbers():
    machine, p, _ = make_machine()
    machine.trace = __import__("trainloop").Trace()
    machine.advance(), machine.advance()
    p.step = 1
    machine.advance()
    p.step = 2
    machine.advance()
    assert [(e.step, e.dest) for e in machine.trace] == [
        (0, State.BUILDING), (0, State.RESTORING), (1, State.STEPPING), (2, State.STEPPING)
    ]
    assert machine.trace.counts()[(State.STEPPING, State.STEPPING, "begin_step")] == 1


def test_mermaid_and_dot_are_drawn_from_the_table():
    mermaid = draw(format="mermaid")
    dot = draw(format="dot")
    assert mermaid.startswith("stateDiagram-v2\n")
    assert dot.startswith("digraph trainloop {")
    for t in TRANSITIONS:
        label = f"{t.trigger} [{t.condition}]" if t.condition else t.trigger
        assert f"{t.source.value} --> {t.dest.value}: {label}" in mermaid
        assert f'"{t.source.value}" -> "{t.dest.value}" [label="{label}"' in dot
    assert len(mermaid.splitlines()) == len(TRANSITIONS) + 3
    with pytest.raises(ValueError, match="unknown diagram format 'svg'"):
        draw(format="svg")
