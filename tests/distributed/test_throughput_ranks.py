"""Throughput across ranks, for real: two gloo processes whose items differ, against a hand count."""

from __future__ import annotations

import itertools
import os

import pytest
import torch
import torch.multiprocessing as mp
from ddp_worker import free_port
from throughput_worker import counted_ranks
from tiny_trainer import items_mask, make_data
from torch.utils.data import DataLoader

WORLD = 2


def hand_counts(rank_: int, batches: int) -> list[int]:
    """The items of each batch rank ``rank_`` draws: its data's mask, plus ``rank_`` per batch."""
    epoch = [int(items_mask(x).sum()) + rank_ for x, _ in DataLoader(make_data(seed=rank_), batch_size=8)]
    return list(itertools.islice(itertools.cycle(epoch), batches))


@pytest.fixture(scope="module")
def emitted(tmp_path_factory):
    out = tmp_path_factory.mktemp("throughput_ranks")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.spawn(counted_ranks, args=(WORLD, free_port(), str(out)), nprocs=WORLD, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def test_each_rank_counts_its_own_items_and_the_total_is_the_sum_over_ranks(emitted):
    # 6 steps of 2 microsteps, emitted every 3 steps: windows of 6 batches per rank.
    counts = [hand_counts(r, 12) for r in range(WORLD)]
    windows = [(0, 6), (6, 12)]
    for r, rank_emitted in enumerate(emitted):
        assert [step for step, _ in rank_emitted] == [3, 6]
        for (_, rate), (a, b) in zip(rank_emitted, windows, strict=True):
            assert rate.items == sum(counts[r][a:b])
            assert rate.total_items == sum(sum(c[a:b]) for c in counts)
    assert counts[0] != counts[1]  # the ranks did count differently
    for window in range(2):
        rates = [rank_emitted[window][1] for rank_emitted in emitted]
        # Every rank reports the same total: the ranks' own rates added up.
        assert rates[0].total_items_per_second == rates[1].total_items_per_second
        assert rates[0].total_items_per_second == pytest.approx(sum(rate.items_per_second for rate in rates))
