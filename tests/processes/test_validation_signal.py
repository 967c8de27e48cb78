"""Exit signals leave fast: after SIGTERM the run saves and exits without validating, unless asked.

Real processes (``trainloop run`` in a subprocess), real signals, a long validation (it sleeps).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys

from cli_process import cli_env

from trainloop.checkpoint import checkpoint_steps
from trainloop.machine import State, read_trace

TRAINER = "eval_trainers:EvalTrainer"


def settings(tmp_path, **extra):
    return {
        "max_steps": 200, "workspace": str(tmp_path / "ws"), "trace": True, "val_marker": str(tmp_path / "marker"),
        "hooks": [
            {"type": "validation", "evaluate": "val_metrics", "interval": 1},
            {"type": "checkpointing", "interval": 1000},
        ],
        **extra,
    }


def start(tmp_path, config, *args):
    (tmp_path / "run.json").write_text(json.dumps(config))
    return subprocess.Popen(
        [sys.executable, "-m", "trainloop", "run", "run.json", "--trainer", TRAINER, *args],
        cwd=tmp_path, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def validations(tmp_path):
    """(step, start time) of every validation the run made."""
    lines = (tmp_path / "marker").read_text().split("\n")
    return [(int(step), float(at)) for step, at in (line.split() for line in lines if line)]


def test_sigterm_during_the_steps_saves_and_exits_143_without_validating(tmp_path):
    # A long validation after every step; the process gets SIGTERM in step 3's forward (a real
    # signal, sent by the child to itself so that it lands in a known step).
    child = start(tmp_path, settings(tmp_path, val_sleep=0.5, signal_at_step=3))
    _, stderr = child.communicate(timeout=120)
    assert child.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert "Caught SIGTERM during step 3" in stderr
    assert [step for step, _ in validations(tmp_path)] == [1, 2]  # step 3, due, was not validated
    assert checkpoint_steps(tmp_path / "ws" / "checkpoints") == [3]  # but saved
    trace = read_trace(tmp_path / "ws" / "trace.jsonl")
    assert [e.step for e in trace if e.dest is State.VALIDATING] == [1, 2]
    assert [(e.source, e.dest) for e in trace[-2:]] == [
        (State.STEPPING, State.CHECKPOINTING), (State.CHECKPOINTING, State.EXITING)
    ]
    assert "Validation at step 3" not in stderr


def test_on_exit_signal_validate_validates_the_exit_step_first(tmp_path):
    # The child signals itself in step 3's forward; by default step 3 is saved, not validated.
    skip, validate = tmp_path / "skip", tmp_path / "validate"
    skip.mkdir(), validate.mkdir()
    skipped = start(skip, settings(skip, signal_at_step=3))
    opted = start(validate, settings(validate, signal_at_step=3), "--set", "hooks.validation.on_exit_signal=validate")
    assert skipped.wait(timeout=120) == 143, skipped.stderr.read()[-3000:]
    assert opted.wait(timeout=120) == 143, opted.stderr.read()[-3000:]
    assert [step for step, _ in validations(skip)] == [1, 2]
    assert [step for step, _ in validations(validate)] == [1, 2, 3]
    for workspace in (skip / "ws", validate / "ws"):
        assert checkpoint_steps(workspace / "checkpoints") == [3]
    trace = read_trace(validate / "ws" / "trace.jsonl")
    assert [(e.source, e.dest) for e in trace[-3:]] == [
        (State.STEPPING, State.VALIDATING), (State.VALIDATING, State.CHECKPOINTING), (State.CHECKPOINTING, State.EXITING)
    ]
