"""Ranks of the gloo groups that tests/checkpoint/test_ranks.py forks (importable by module name).

Each worker joins the group on 127.0.0.1, runs its scenarios one after another (a fork is cheap,
joining a group is not) and saves what it saw to ``<out>/rank<r>.pt``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hooks"))  # checkpoint_child
from checkpoint_child import StepDataTrainer  # noqa: E402

from trainloop.checkpoint import CheckpointError  # noqa: E402
from trainloop.hooks.checkpointing import CheckpointingHook  # noqa: E402


def join(rank: int, world: int, port: int) -> None:
    """Join a gloo group on the loopback interface, one thread per rank."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def unshared_storage(rank: int, world: int, port: int, out: str) -> None:
    """Each rank in its own working directory, saving under the same relative workspace: as on
    nodes with local disks, no rank sees the others' files."""
    join(rank, world, port)
    try:
        cwd = Path(out) / f"cwd{rank}"
        cwd.mkdir()
        os.chdir(cwd)
        results: dict[str, Any] = {}
        for async_save in (False, True):
            hook = CheckpointingHook(interval=2, format="sharded", async_save=async_save)
            try:
                StepDataTrainer(max_steps=2, workspace=f"async{int(async_save)}", hooks=[hook]).train()
                results[f"async{int(async_save)}"] = "saved"
            except CheckpointError as error:
                results[f"async{int(async_save)}"] = f"{type(error).__name__}: {error}"
        torch.save(results, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
