"""Checkpoints saved and verified by several ranks for real: gloo processes on 127.0.0.1."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import ranks_worker
import torch
import torch.multiprocessing as mp
from ddp_worker import free_port

from trainloop.checkpoint import latest_checkpoint

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


def test_every_rank_hashes_its_own_files_and_a_corrupt_shard_of_another_rank_is_refused(tmp_path):
    results = fork(ranks_worker.shared_verification, 2, tmp_path)
    assert [result["started"] for result in results] == [2, 2]  # step 4 refused, 2 loaded
    skipped = [m for m in results[0]["messages"] if m.startswith("Skipping checkpoint")]
    assert len(skipped) == 1
    assert f"{tmp_path / 'ws' / 'checkpoints' / '4' / 'sharded' / '__1_0.distcp'}: cannot load: corrupt" in skipped[0]
    assert not any(m.startswith("Skipping") for m in results[1]["messages"])  # rank 0 reports

    def hashed(rank: int, step: int) -> tuple[list[str], int]:
        """The files rank ``rank`` hashed of checkpoint ``step``, and how many it holds."""
        lines = [m for m in results[rank]["messages"] if m.startswith(f"Rank {rank} hashed ") and f"checkpoints/{step}:" in m]
        assert len(lines) == 1, results[rank]["messages"]
        total = int(lines[0].split(" of the ")[1].split()[0])
        return ast.literal_eval(lines[0].split(": ", 1)[1]), total

    for step in (4, 2):
        (share0, total), (share1, _) = hashed(0, step), hashed(1, step)
        assert "sharded/__0_0.distcp" in share0
        assert "sharded/__1_0.distcp" in share1  # each its own
        assert not set(share0) & set(share1)
        assert len(share0) + len(share1) == total  # the union, once
        assert {"metadata.json", "training_state.pt", "sharded/.metadata"} <= set(share0 + share1)


#: The documented bound (docs/checkpointing.md) on how far a resume on 3 or more DDP ranks may
#: drift from the unbroken run: float32 rounding of one step's gradient sums, in another order.
DDP_RESUME_TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


def test_four_ddp_ranks_resume_within_the_documented_tolerance(tmp_path):
    results = fork(ranks_worker.four_rank_resume, 4, tmp_path)
    straight = results[0]["straight"]
    for result in results:
        for a, b in zip(result["straight"], straight):
            assert torch.equal(a, b)  # DDP keeps every rank's parameters identical
        for label in ("ddp-full", "ddp-sharded"):
            assert result[label]["started"] == 4
            for a, b in zip(result[label]["params"], straight):
                torch.testing.assert_close(a, b, **DDP_RESUME_TOLERANCE)
        # With find_unused_parameters=True DDP keeps its first bucket order: bitwise equal.
        assert result["ddp_unused-full"]["started"] == 4
        for a, b in zip(result["ddp_unused-full"]["params"], result["straight_unused"]):
            assert torch.equal(a, b), (a - b).abs().max()
    drift = max((a - b).abs().max().item() for a, b in zip(results[0]["ddp-full"]["params"], straight))
    print(f"4 DDP ranks: largest parameter difference after a resume {drift:.3g}")
