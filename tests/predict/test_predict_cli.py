"""``trainloop predict`` in a subprocess, as a user runs it: exit codes, one line per problem, files written or not."""

from __future__ import annotations

import json
import os

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


def test_outputs_whose_item_shape_or_dtype_changes_exit_1_naming_the_batch_and_both(tmp_path, trained):
    # Issue 29, defect 3: the end came in torch.cat's RuntimeError (a traceback naming neither batch nor
    # shape); a dtype that changed was silently promoted.
    said = {
        "wider": "returned a tensor of shape (4, 2) for batch 2, where batch 0's items have shape (1,)",
        "flat": "returned a tensor of shape (4,) for batch 2, where batch 0's items have shape (1,)",
        "double": "returned a torch.float64 tensor for batch 2, where batch 0's is torch.float32 (convert in predict_step)",
    }
    runs = {
        kind: Cli("predict", "predict.json", "--set", f"returns={kind}", "--set", "wrong_at_batch=2", "-o", f"{kind}.pt", cwd=tmp_path)
        for kind in said
    }
    for kind, run in runs.items():
        result = run.result()
        assert result.returncode == 1, result.stderr[-3000:]
        errors = [line for line in result.stderr.splitlines() if ": error: " in line]
        assert errors == [
            f"trainloop predict: error: PredictTrainer.predict_step() {said[kind]}: every batch must give items of one "
            "shape and one dtype"
        ]
        assert "Traceback" not in result.stderr
        assert not (tmp_path / f"{kind}.pt").exists()


def test_an_output_that_cannot_be_written_is_found_before_anything_is_predicted(tmp_path, trained):
    # Issue 29, defect 4: FileExistsError, SafetensorError or torch's RuntimeError, with a traceback, after
    # predicting everything.
    (tmp_path / "afile").write_text("")
    outputs = {"afile/preds.safetensors": "afile/preds.safetensors: afile: is a file, not a directory"}
    if os.path.isdir("/proc/self"):  # refuses new files whatever the permissions say (root too)
        outputs["/proc/preds.pt"] = "/proc/preds.pt: cannot create a file in /proc: No such file or directory"
    runs_before = read_runs(trained)
    runs = {output: Cli("predict", "predict.json", "--output", output, cwd=tmp_path) for output in outputs}
    for output, run in runs.items():
        result = run.result()
        assert result.returncode == 1, result.stderr[-3000:]
        assert [line for line in result.stderr.splitlines() if ": error: " in line] == [
            f"trainloop predict: error: {outputs[output]}"
        ]
        assert "Traceback" not in result.stderr
        assert "Predicted" not in result.stderr
        assert "Loaded" not in result.stderr
    assert read_runs(trained) == runs_before  # refused before it was a run
    with pytest.raises(OSError, match=f"^{tmp_path}/afile/x.pt: {tmp_path}/afile: is a file, not a directory$"):
        PredictTrainer(max_steps=4, workspace=trained).predict(output=tmp_path / "afile" / "x.pt")
