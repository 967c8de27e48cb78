"""The DDP and FSDP examples, launched as their READMEs say: torchrun, two processes, gloo on CPU."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from child_process import HIDDEN_GPUS

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")
STEPS = 100  # the examples default to 150; 100 reach 90% and keep the test short
ACCURACY = re.compile(rf"^final accuracy (\d\.\d{{4}}) after {STEPS} steps on 2 ranks$", re.MULTILINE)


def load(path: Path):
    spec = importlib.util.spec_from_file_location(f"example_{path.parent.name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # main() runs only under __main__
    return module


def torchrun(script: Path, workspace: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    env.update(OMP_NUM_THREADS="1", **HIDDEN_GPUS)  # the examples on the CPU, gloo (their default there)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        str(script), "--workspace", str(workspace), "--max-steps", str(STEPS),
    ]  # fmt: skip
    # --standalone: a rendezvous on localhost, on a free port.
    return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=workspace, env=env, check=False)


@pytest.mark.parametrize("name", ["ddp", "fsdp"])
def test_example_trains_on_two_ranks_and_rank_zero_writes_full_checkpoints(tmp_path, name):
    pytest.importorskip("sklearn")
    script = ROOT / "examples" / name / "train.py"
    run = torchrun(script, tmp_path)
    assert run.returncode == 0, f"exit code {run.returncode}\n{run.stdout}\n{run.stderr[-4000:]}"

    printed = ACCURACY.findall(run.stdout)
    assert len(printed) == 1, run.stdout  # rank 0 alone prints it
    accuracy = float(printed[0])
    assert accuracy >= 0.9
    assert f"Step {STEPS}/{STEPS}" in run.stderr  # ProgressHook on rank 0 (logging writes to stderr)

    checkpoints = tmp_path / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == [str(STEPS), "latest"]
    # Full tensors with plain names: the checkpoint loads into an unwrapped model, which then
    # scores what the distributed run printed.
    example = load(script)
    trainer = example.DigitsTrainer(max_steps=1)
    trainer.val_set = example.load_split()[1]
    torch.manual_seed(1)
    trainer.model = _unwrapped_model(example, name)
    state = torch.load(checkpoints / "latest" / "model.pt", weights_only=True)
    trainer.model.load_state_dict(state)  # strict: every key and shape must match
    assert f"{trainer.accuracy():.4f}" == printed[0]


def _unwrapped_model(example, name):
    """The example's architecture without DDP or FSDP (wrap_model's 'auto' returns it alone)."""
    trainer = example.DigitsTrainer(max_steps=1, device="cpu")
    if name == "ddp":
        return trainer.build_model()
    from torch import nn

    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), example.Block(128), example.Block(128), nn.Linear(128, 10))
