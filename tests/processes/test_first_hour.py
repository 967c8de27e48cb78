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


# -- issue 29's first-hour frictions, through the command line ------------------------------------


def _messages(stderr: str) -> list[str]:
    """The log lines of ``trainloop run`` (``<date> <time> LEVEL name: message``), as messages."""
    return [line.split(": ", 1)[1] for line in stderr.splitlines() if " trainloop: " in line]


def test_a_fine_tune_and_a_resume_each_say_what_happens_in_one_line(tmp_path, isolated_cli, capsys):
    from cli_process import Cli, call

    hooks = [{"type": "checkpointing", "interval": 2}]
    (tmp_path / "pre.json").write_text(json.dumps({"max_steps": 2, "workspace": "pre", "hooks": hooks}))
    trainer = ("--trainer", "cli_trainers:CliTrainer")
    # The run to fine-tune from, in this process through main() (a subprocess costs ~6 s of CPU);
    # the fine-tune and the resume, whose lines this test reads, are real subprocesses.
    assert call(capsys, "run", "pre.json", *trainer)[0] == 0
    (tmp_path / "tune.json").write_text(json.dumps({"max_steps": 2, "workspace": "tune", "hooks": hooks, "init_from": "pre"}))
    tune = Cli("run", "tune.json", *trainer, cwd=tmp_path).result()
    assert tune.returncode == 0, tune.stderr
    said = [m for m in _messages(tune.stderr) if "checkpoint" in m.lower() or "init" in m.lower()]
    assert said[:2] == [  # not "starting from scratch", right before loading other weights
        "No checkpoint in tune/checkpoints: starting from the init_from weights (pre)",
        f"Initialised 4 weights of the model from {tmp_path}/pre/checkpoints/2 (step 2)",
    ]
    resumed = Cli("run", "tune.json", *trainer, "--set", "max_steps=4", cwd=tmp_path).result()
    assert resumed.returncode == 0, resumed.stderr
    said = [m for m in _messages(resumed.stderr) if "esum" in m or "Loading" in m or "init_from" in m]
    assert said == [  # "Loading checkpoint ...", "Resuming from step ..." no more
        f"Resumed from {tmp_path}/tune/checkpoints/2 at step 2",
        "init_from pre not loaded: the run resumed its own checkpoint at step 2",
    ]


@pytest.fixture
def twenty_steps(tmp_path):
    """A run of 20 steps (8 batches an epoch: 2 epochs completed), its checkpoint at step 20."""
    from cli_process import Cli

    hooks = [{"type": "checkpointing", "interval": 20}, {"type": "validation", "evaluate": "val_metrics", "interval": 20}]
    settings = {"max_steps": 20, "workspace": "ws", "hooks": hooks, "trainer": "predict_trainers:ModuleNamedTrainer"}
    (tmp_path / "run.json").write_text(json.dumps(settings))
    assert Cli("run", "run.json", cwd=tmp_path).result().returncode == 0
    (train,) = read_runs(tmp_path / "ws")
    assert (train["kind"], train["step"], train["epoch"]) == ("train", 20, 2)
    return tmp_path / "ws"


def test_predict_records_the_checkpoints_step_and_epoch(tmp_path, twenty_steps):
    # runs.jsonl said "epoch": 0 for a checkpoint of epoch 37, and the report showed 0 epochs.
    from cli_process import Cli

    predicted = Cli("predict", "run.json", cwd=tmp_path).result()
    assert predicted.returncode == 0, predicted.stderr
    predict = read_runs(twenty_steps)[-1]
    assert (predict["kind"], predict["step"], predict["epoch"]) == ("predict", 20, 2)
    page = build_report(twenty_steps)  # the runs table: kind, ..., step, epochs
    assert page.count('<td class="num">20</td><td class="num">2</td>') == 2


def test_evaluate_records_the_checkpoints_step_and_epoch(tmp_path, twenty_steps):
    from cli_process import Cli

    evaluated = Cli("evaluate", "run.json", cwd=tmp_path).result()
    assert evaluated.returncode == 0, evaluated.stderr
    evaluate = read_runs(twenty_steps)[-1]
    assert (evaluate["kind"], evaluate["step"], evaluate["epoch"]) == ("evaluate", 20, 2)


def test_a_resume_refused_before_its_first_step_leaves_the_workspace_as_it_was(tmp_path):
    # docs/cli.md: exit 2 writes nothing, not even a refused resume's line in runs.jsonl.
    from cli_process import Cli

    (tmp_path / "run.yaml").write_text("max_steps: 2\nworkspace: ws\nhooks:\n  - {type: checkpointing, interval: 2}\n")
    trainer = ("--trainer", "cli_trainers:CliTrainer")
    assert Cli("run", "run.yaml", *trainer, cwd=tmp_path).result().returncode == 0
    before = {p: p.read_bytes() for p in (tmp_path / "ws").rglob("*") if p.is_file()}
    assert tmp_path / "ws" / "runs.jsonl" in before

    refused = Cli("run", "run.yaml", *trainer, "--set", "gradient_accumulation_steps=2", cwd=tmp_path).result()
    assert refused.returncode == 2
    errors = [line for line in refused.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, refused.stderr
    assert errors[0].startswith("trainloop run: error: the checkpoint's global batch is 8 ")
    assert "gradient_accumulation_steps 2" in errors[0]
    assert {p: p.read_bytes() for p in (tmp_path / "ws").rglob("*") if p.is_file()} == before
    assert [run["exit_code"] for run in read_runs(tmp_path / "ws")] == [0]
