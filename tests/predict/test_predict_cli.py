"""``trainloop predict`` in a subprocess, as a user runs it: exit codes, one line per problem, files written or not."""

from __future__ import annotations

import json

import pytest
import torch
from cli_process import Cli, assert_one_clean_error, call
from predict_trainers import PredictTrainer
from safetensors.torch import load_file

from trainloop import CheckpointingHook
from trainloop.core.result import read_runs

TRAINER = "predict_trainers:PredictTrainer"

pytestmark = pytest.mark.usefixtures("isolated_cli")  # see tests/conftest.py


@pytest.fixture
def trained(tmp_path):
    ws = tmp_path / "ws"
    PredictTrainer(max_steps=4, workspace=ws, hooks=[CheckpointingHook(interval=4)]).train()
    (tmp_path / "predict.json").write_text(json.dumps({"max_steps": 4, "workspace": "ws", "trainer": TRAINER}))
    return ws


def test_predict_writes_the_workspace_file_and_a_bad_predict_step_writes_nothing(tmp_path, trained):
    good = Cli("predict", "predict.json", "--set", "items=9", cwd=tmp_path)
    bad = Cli("predict", "predict.json", "--set", "returns=list", "--set", "wrong_at_batch=1", "--output", "bad.pt", cwd=tmp_path)
    done, failed = good.result(), bad.result()
    assert done.returncode == 0, done.stderr[-3000:]
    assert "trainloop predict: wrote the predictions of 9 items to ws/predictions.safetensors" in done.stderr
    written = load_file(trained / "predictions.safetensors")
    expected = PredictTrainer(max_steps=4, workspace=trained, items=9).predict(output=tmp_path / "ref.pt")
    assert torch.equal(written["x"], expected["x"])
    torch.testing.assert_close(written["y"], expected["y"])
    # A predict_step that returns a list: exit 1, one line naming the batch, no file.
    assert failed.returncode == 1, failed.stderr[-3000:]
    errors = [line for line in failed.stderr.splitlines() if ": error: " in line]
    assert errors == [
        "trainloop predict: error: PredictTrainer.predict_step() returned a list for batch 1: it must return a "
        "tensor, or a dict of str to tensors, whose first dimension is the batch's items"
    ]
    assert "Traceback" not in failed.stderr
    assert not (tmp_path / "bad.pt").exists()
    assert [(run["kind"], run["exit_code"]) for run in read_runs(trained)][-3:-1] == [("predict", 0), ("predict", 1)] or {
        (run["kind"], run["exit_code"]) for run in read_runs(trained)[1:3]
    } == {("predict", 0), ("predict", 1)}


def test_refusals_before_anything_is_built(tmp_path, capsys, trained):
    before = sorted(p.name for p in trained.iterdir())
    code, _, err = call(capsys, "predict", "predict.json", "--trainer", "tiny_trainer:TinyTrainer")
    assert code == 2
    assert_one_clean_error(err, "TinyTrainer must implement build_predict_data_loader()", "must implement predict_step()")
    code, _, err = call(capsys, "predict", "predict.json", "--output", "preds.json")
    assert code == 2
    assert_one_clean_error(err, "--output: the predictions output 'preds.json' ends in '.json'")
    code, _, err = call(capsys, "predict", "predict.json", "--set", "workspace=null")
    assert code == 2
    assert_one_clean_error(err, "the settings have no workspace: give --output FILE")
    code, _, err = call(capsys, "predict", "predict.json", "--checkpoint", "nowhere")
    assert code == 1
    assert_one_clean_error(err, "checkpoint nowhere: no such directory")
    assert sorted(p.name for p in trained.iterdir()) == before or "predictions.safetensors" not in {p.name for p in trained.iterdir()}


def test_a_terminal_sees_a_progress_bar(tmp_path, trained):
    import fcntl
    import os
    import pty
    import struct
    import subprocess
    import sys
    import termios

    from cli_process import cli_env

    controller, terminal = pty.openpty()  # stderr is a terminal, as in a user's shell, 100 columns wide
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 100, 0, 0))
    process = subprocess.Popen(
        [sys.executable, "-m", "trainloop", "predict", "predict.json", "--set", "items=9", "--output", "p.pt"],
        cwd=tmp_path, env=cli_env(), stdout=subprocess.DEVNULL, stderr=terminal,
    )
    os.close(terminal)
    seen = b""
    while True:
        try:
            chunk = os.read(controller, 4096)
        except OSError:  # the process closed the terminal
            break
        if not chunk:
            break
        seen += chunk
    assert process.wait(timeout=180) == 0, seen.decode(errors="replace")[-2000:]
    os.close(controller)
    assert b"predict: 100%" in seen, seen.decode(errors="replace")
    assert b"3/3" in seen  # 9 items, 4 per batch: 3 batches
