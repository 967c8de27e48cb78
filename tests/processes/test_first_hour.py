"""The first hour of a new user, run as they would: a script in a fresh process (no logging
configured), run again, rerun once complete; the README's environment example on the demo."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from cli_process import REPO, cli_env
from tiny_trainer import TinyTrainer

from trainloop import LoggingHook
from trainloop.core.result import read_runs
from trainloop.report import build_report

SCRIPT = """\
import sys
from tiny_trainer import TinyTrainer
from trainloop import CheckpointingHook, ValidationHook

hooks = [ValidationHook(lambda t: {"loss": 1.0 / t.step}, interval=5),
         CheckpointingHook(interval=5, keep_best=1, monitor="val/loss")]
result = TinyTrainer(max_steps=int(sys.argv[1]), hooks=hooks, workspace="ws").train()
print("step", result.step, "best", result.best_checkpoint)
"""


def _script(tmp_path: Path, max_steps: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-W", "always", "train.py", str(max_steps)], cwd=tmp_path, env=cli_env(),
        capture_output=True, text=True, timeout=180, check=False,
    )


def test_a_run_says_what_it_starts_from_and_a_complete_run_is_not_run_again(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    fresh = _script(tmp_path, 10)
    assert fresh.returncode == 0, fresh.stderr
    assert fresh.stderr.count("\n") == 1, fresh.stderr  # one line, nothing else
    assert fresh.stderr == "trainloop: No checkpoint in ws/checkpoints: starting from scratch\n"
    longer = _script(tmp_path, 15)  # max_steps changed: a ChangedSettingsWarning too
    assert longer.stderr.endswith(f"\ntrainloop: Resumed from {tmp_path}/ws/checkpoints/10 at step 10\n"), longer.stderr
    again = _script(tmp_path, 15)
    assert again.returncode == 0
    assert again.stderr == (  # no MonitorNotFoundWarning, nothing else
        f"trainloop: Resumed from {tmp_path}/ws/checkpoints/15 at step 15: the run is already complete (15 steps); nothing to train\n"
    )
    assert again.stdout == "step 15 best ws/checkpoints/15\n"
    assert [(run["step"], run["exit_code"]) for run in read_runs(tmp_path / "ws")] == [(10, 0), (15, 0)]
    assert build_report(tmp_path / "ws").count(">completed<") == 2


def test_a_workspace_records_the_loss_and_lr_by_default(tmp_path):
    # As the README declares a run: no hook at all, a workspace.
    result = TinyTrainer(max_steps=25, workspace=tmp_path / "ws").train()
    rows = [json.loads(line) for line in (tmp_path / "ws" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [10, 20, 25]
    assert all("loss" in r and r["lr/group_0"] == 0.05 for r in rows)
    assert result.metrics["loss"] == rows[-1]["loss"]
    assert result.metrics["lr/group_0"] == 0.05
    page = build_report(tmp_path / "ws")
    assert "last loss (mean of steps 21-25)" in page
    assert "No metrics.jsonl" not in page


def test_a_declared_logging_hook_or_metrics_file_off_replaces_the_default(tmp_path):
    TinyTrainer(max_steps=6, workspace=tmp_path / "a", hooks=[LoggingHook(interval=3)]).train()
    assert [json.loads(line)["step"] for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()] == [3, 6]
    TinyTrainer(max_steps=6, workspace=tmp_path / "b", metrics_file=False).train()
    assert not (tmp_path / "b" / "metrics.jsonl").exists()


def test_the_readme_environment_example_works_on_the_demo(tmp_path):
    pytest.importorskip("sklearn")
    result = subprocess.run(
        [sys.executable, "-m", "trainloop", "validate", str(REPO / "examples" / "digits" / "settings.json"),
         "--trainer", "examples.digits.train:DigitsTrainer"],
        cwd=REPO, env=cli_env(TRAINLOOP_OPTIMIZER__LR="0.02"), capture_output=True, text=True, timeout=180, check=False,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["optimizer"]["lr"] == 0.02
