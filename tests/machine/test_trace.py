import json

import pytest
from tiny_trainer import TinyTrainer

from trainloop import State
from trainloop.machine import read_trace, summarize_trace
from trainloop.machine.trace import Trace, TraceEntry


def test_a_traced_run_writes_trace_jsonl_and_settings_json(tmp_path):
    trainer = TinyTrainer(max_steps=3, gradient_accumulation_steps=2, trace=True, workspace=tmp_path)
    assert trainer.trace is None  # nothing is recorded or written before train()
    trainer.train()
    entries = read_trace(tmp_path / "trace.jsonl")
    assert entries == list(trainer.trace)
    assert [(e.source, e.dest) for e in entries[:3]] == [
        (State.IDLE, State.BUILDING), (State.BUILDING, State.RESTORING), (State.RESTORING, State.ACCUMULATING)
    ]
    summary = summarize_trace(entries)
    assert summary.steps == 3
    assert summary.counts[(State.ACCUMULATING, State.ACCUMULATING, "accumulate")] == 3
    assert summary.counts[(State.ACCUMULATING, State.STEPPING, "update")] == 3
    assert summary.counts == trainer.trace.counts()
    assert set(summary.seconds_in_state) >= {State.BUILDING, State.STEPPING, State.ACCUMULATING}
    assert all(seconds >= 0 for seconds in summary.seconds_in_state.values())
    saved = json.loads((tmp_path / "settings.json").read_text())
    assert saved["max_steps"] == 3
    assert saved["trace"] is True


def test_memory_is_bounded_but_counts_cover_the_run():
    trace = Trace(keep=2)
    for step in range(5):
        trace.append(TraceEntry(float(step), step, State.STEPPING, State.ACCUMULATING, "begin_step"))
    assert [e.step for e in trace] == [3, 4]
    assert trace.counts()[(State.STEPPING, State.ACCUMULATING, "begin_step")] == 5


def test_a_bad_trace_line_names_the_file_and_line(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text('{"time": 1, "step": 0, "source": "idle", "dest": "building", "trigger": "start"}\n{"time": 2}\n')
    with pytest.raises(ValueError, match=r"trace\.jsonl:2: not a trace entry"):
        read_trace(path)


def entry(time, source, dest, trigger, step=0):
    return TraceEntry(time, step, State(source), State(dest), trigger)


def test_a_resumed_run_appending_to_the_trace_adds_no_time_between_runs():
    runs = [
        entry(0.0, "idle", "building", "start"), entry(1.0, "building", "restoring", "restore"),
        entry(2.0, "restoring", "exiting", "finish"),
        entry(100.0, "idle", "building", "start"), entry(103.0, "building", "restoring", "restore"),
    ]
    summary = summarize_trace(runs)
    assert summary.seconds_in_state[State.BUILDING] == 4.0
    assert State.EXITING not in summary.seconds_in_state  # the 98 s between the runs


def test_a_cut_off_last_line_of_a_live_trace_is_skipped(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text('{"time": 1, "step": 0, "source": "idle", "dest": "building", "trigger": "start"}\n{"time": 2, "st')
    assert len(read_trace(path)) == 1
