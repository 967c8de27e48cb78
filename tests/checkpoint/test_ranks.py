"""Checkpoints saved and verified by several ranks for real: gloo processes on 127.0.0.1."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from ddp_worker import free_port

from trainloop.checkpoint import latest_checkpoint

import sys  # noqa: I001
sys.path.insert(0, str(Path(__file__).resolve().parent))  # ranks_worker, beside this file
import ranks_worker  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")


def fork(worker, world: int, out: Path) -> list[dict]:
    """Run ``worker`` on ``world`` forked ranks; their results."""
    mp.start_processes(worker, args=(world, free_port(), str(out)), nprocs=world, start_method="fork")
    return [torch.load(out / f"rank{rank}.pt", weights_only=True) for rank in range(world)]


def tree(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))


def test_sharded_save_on_storage_rank_zero_cannot_see_fails_on_every_rank_and_publishes_nothing(tmp_path):
    results = fork(ranks_worker.unshared_storage, 2, tmp_path)
    for rank, result in enumerate(results):
        # The foreground save: every rank raises the same error, naming the cause.
        message = result["async0"]
        assert message.startswith("CheckpointError: could not save checkpoint async0/checkpoints/2: rank 1 "
                                  "cannot see async0/checkpoints/.2.tmp-"), (rank, message)
        assert "storage every rank shares, under the same path" in message
    # In the background, rank 0 finds it when the save completes (at the end of the run).
    assert results[0]["async1"].startswith("CheckpointError: could not save checkpoint async1/checkpoints/2: rank 1")
    for rank in range(2):
        for workspace in ("async0", "async1"):
            root = tmp_path / f"cwd{rank}" / workspace / "checkpoints"
            assert latest_checkpoint(root) is None
            assert not root.exists() or tree(root) == [], (rank, workspace, tree(root))
