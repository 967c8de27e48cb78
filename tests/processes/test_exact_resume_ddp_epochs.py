"""Two DDP ranks, a plain DataLoader over a shuffling DistributedSampler, dropout, sharded checkpoints: a run killed
after the save at an epoch's last step resumes in new processes bitwise identical to the unbroken run.

The next epoch's iterator draws its base seed from torch's generator as it begins: a resume that began it before
restoring the checkpoint's generators left them one draw behind at the next forward, so the dropout masks differed.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import torch
from child_process import HIDDEN_GPUS, ChildProcess
from ddp_worker import free_port

CHILD = Path(__file__).resolve().parents[1] / "support" / "resume_child.py"
TIMEOUT = 240
MAX_STEPS = 12
BOUNDARY = 5  # 40 items, 2 ranks, batches of 4: 5 steps an epoch


def pair(tmp, runs):
    port = str(free_port())
    env = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, **HIDDEN_GPUS}
    return [ChildProcess(CHILD, [json.dumps(runs)], tmp, {**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(2)]


def test_two_ddp_ranks_killed_after_a_sharded_save_at_an_epochs_end_resume_bitwise(tmp_path):
    run = {"workspace": str(tmp_path / "ws"), "max_steps": MAX_STEPS, "loader": "plain", "format": "sharded"}
    first = pair(tmp_path, [
        {**run, "workspace": str(tmp_path / "ref"), "out": str(tmp_path / "ref.out")},
        {**run, "interval": BOUNDARY, "pause_after_save": BOUNDARY},
    ])
    second: list[ChildProcess] = []
    try:
        for rank, child in enumerate(first):
            child.wait_for(f"{rank} paused {BOUNDARY}", timeout=TIMEOUT, exact=True)
        for child in first:
            child.proc.send_signal(signal.SIGKILL)
            child.finish(timeout=TIMEOUT)
        second = pair(tmp_path, [{**run, "interval": 1000, "out": str(tmp_path / "resumed.out")}])
        assert [child.finish(timeout=TIMEOUT) for child in second] == [0, 0], second[0].stderr()
    finally:
        for child in [*first, *second]:
            if child.proc.poll() is None:
                child.proc.kill()
                child.proc.wait()
    for rank in range(2):
        resumed = torch.load(f"{tmp_path / 'resumed.out'}.rank{rank}", weights_only=True)
        unbroken = torch.load(f"{tmp_path / 'ref.out'}.rank{rank}", weights_only=True)
        assert (resumed["started"], resumed["step"]) == (BOUNDARY, MAX_STEPS)
        for got, want in zip(resumed["params"], unbroken["params"], strict=True):
            assert torch.equal(got, want), (got - want).abs().max()
