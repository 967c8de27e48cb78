"""docs/first_trainer.md, run as a newcomer runs it: its files written as shown, its commands run as
written in a shell (the installed ``trainloop`` script), its Python script run as a script.

The page promises that the stopped-and-resumed run is the unbroken run: an unbroken run of the same
settings, started beside it, ends with weights and optimizer state ``torch.equal`` to it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from cli_process import Cli, cli_env, console_script

from trainloop.checkpoint import read_checkpoint
from trainloop.core.result import read_runs

PAGE = Path(__file__).resolve().parents[2] / "docs" / "first_trainer.md"


def _example(name: str) -> str:
    """The code block under ``<!-- example: name -->`` on the page."""
    after = PAGE.read_text().split(f"<!-- example: {name} -->\n", 1)[1]
    return after.split("```", 2)[1].split("\n", 1)[1]


def _equal(a: object, b: object) -> bool:
    """Whether two nested states hold the same values, tensors compared bit for bit."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(_equal, a, b))
    return a == b


def test_the_first_trainer_page_runs_as_written_and_its_resumed_run_is_the_unbroken_run(tmp_path):
    for name in ("my_trainer.py", "run.yaml", "train.py"):
        (tmp_path / name).write_text(_example(name))
    env = cli_env()
    env["PATH"] = os.pathsep.join([str(Path(console_script()).parent), env["PATH"]])
    unbroken = Cli("run", "run.yaml", "--set", "workspace=runs/unbroken", cwd=tmp_path, env=env)

    commands = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", _example("commands")], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=600, check=False,
    )
    assert commands.returncode == 0, commands.stderr
    assert "checkpoints/100 at step 100" in commands.stderr  # the second run resumed
    workspace = tmp_path / "runs" / "circle"
    assert [(run["kind"], run["step"], run["exit_code"]) for run in read_runs(workspace)] == [
        ("train", 100, 0), ("train", 200, 0), ("evaluate", 200, 0),
    ]
    evaluated = next(json.loads(line) for line in commands.stdout.splitlines() if line.startswith('{"val/loss"'))
    assert evaluated["val/accuracy"] > 0.9
    assert "step:         200" in commands.stdout  # inspect
    assert (workspace / "report.html").is_file()

    assert unbroken.result().returncode == 0, unbroken.result().stderr
    resumed, whole = read_checkpoint(workspace / "checkpoints" / "200"), read_checkpoint(tmp_path / "runs" / "unbroken" / "checkpoints" / "200")
    assert _equal(resumed["model"], whole["model"])
    for part in ("step", "epoch", "optimizer", "rng", "data_loader"):
        assert _equal(resumed["training_state"][part], whole["training_state"][part]), part

    script = subprocess.run(
        [sys.executable, "train.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False,
    )
    assert script.returncode == 0, script.stderr
    assert script.stdout.startswith("200 {'val/loss': ")
    assert "the run is already complete (200 steps); nothing to train" in script.stderr
