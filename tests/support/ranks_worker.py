"""Ranks of the gloo groups that tests/checkpoint/test_ranks.py forks (importable by module name).

Each worker joins the group on 127.0.0.1, runs its scenarios one after another (a fork is cheap,
joining a group is not) and saves what it saw to ``<out>/rank<r>.pt``.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from checkpoint_child import StartedAt, StepDataTrainer

from trainloop.checkpoint import CheckpointError
from trainloop.distributed import destroy
from trainloop.hooks.checkpointing import CheckpointingHook


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
        destroy(barrier=sys.exc_info()[0] is None)  # wait for every rank: a clean gloo exit


class Messages(logging.Handler):
    """Every message of the ``trainloop`` logger, debug included."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []
        logger = logging.getLogger("trainloop")
        logger.setLevel(logging.DEBUG)
        logger.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def shared_verification(rank: int, world: int, port: int, out: str) -> None:
    """FSDP2 sharded checkpoints at steps 2 and 4; rank 0 corrupts rank 1's shard of step 4 (same
    size: only hashing finds it); the resume verifies with every rank hashing its own files."""
    join(rank, world, port)
    try:
        workspace = Path(out) / "ws"
        hook = CheckpointingHook(interval=2, keep_previous=1, format="sharded")
        StepDataTrainer(max_steps=4, workspace=workspace, wrap="fsdp", hooks=[hook]).train()
        if rank == 0:
            shard = workspace / "checkpoints" / "4" / "sharded" / "__1_0.distcp"
            data = bytearray(shard.read_bytes())
            data[len(data) // 2] ^= 0xFF
            shard.write_bytes(bytes(data))
        dist.barrier()
        messages = Messages()
        started = StartedAt()
        hook = CheckpointingHook(interval=100, keep_previous=1, format="sharded")
        StepDataTrainer(max_steps=6, workspace=workspace, wrap="fsdp", hooks=[started, hook]).train()
        torch.save({"started": started.step, "messages": messages.messages}, Path(out) / f"rank{rank}.pt")
    finally:
        destroy(barrier=sys.exc_info()[0] is None)  # wait for every rank: a clean gloo exit


def four_rank_resume(rank: int, world: int, port: int, out: str) -> None:
    """DDP on ``world`` ranks: an unbroken run of 8 steps, and one saved at step 4 and resumed in
    a new trainer (a fresh DDP, as after a restart) to step 8, in the full and sharded formats."""
    join(rank, world, port)
    try:
        results: dict[str, Any] = {}
        straight = StepDataTrainer(max_steps=8)
        straight.train()
        results["straight"] = [p.detach().clone() for p in straight.model.parameters()]
        for wrap, format in (("ddp", "full"), ("ddp", "sharded"), ("ddp_unused", "full")):
            workspace = Path(out) / f"{wrap}-{format}"
            hook = CheckpointingHook(interval=4, format=format)
            StepDataTrainer(max_steps=4, workspace=workspace, wrap=wrap, hooks=[hook]).train()
            started = StartedAt()
            hook = CheckpointingHook(interval=100, format=format)
            resumed = StepDataTrainer(max_steps=8, workspace=workspace, wrap=wrap, hooks=[started, hook])
            resumed.train()
            params = [p.detach().clone() for p in resumed.model.parameters()]
            results[f"{wrap}-{format}"] = {"started": started.step, "params": params}
        unbroken = StepDataTrainer(max_steps=8, wrap="ddp_unused")
        unbroken.train()
        results["straight_unused"] = [p.detach().clone() for p in unbroken.model.parameters()]
        torch.save(results, Path(out) / f"rank{rank}.pt")
    finally:
        destroy(barrier=sys.exc_info()[0] is None)  # wait for every rank: a clean gloo exit
