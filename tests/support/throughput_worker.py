"""A torchrun-like worker for tests/distributed/test_throughput_ranks.py (spawned: importable by name).

Each rank trains ``ItemsTrainer`` on its own data (``make_data(seed=rank)``) and adds ``rank``
items to every count, so the ranks count differently; a synced ``StatsHook`` emits every 3 steps.
What each emission said goes to ``<out>/rank<r>.pt``.
"""

from __future__ import annotations

import os

import torch
from dist_workers import set_torchrun_env
from tiny_trainer import ItemsTrainer, make_data
from torch.utils.data import DataLoader

from trainloop.distributed import init_distributed
from trainloop.hooks.stats import StatsHook


class Emissions(StatsHook):
    """A synced ``StatsHook`` that keeps every ``TrainingStats`` it emits."""

    def __init__(self) -> None:
        super().__init__(interval=3, sync=True)
        self.emitted: list = []

    def emit(self, trainer, stats) -> None:
        self.emitted.append(stats)


def counted_ranks(rank_: int, world: int, port: int, out: str) -> None:
    """Train 6 steps of 2 microsteps on this rank's data; save the throughput of each emission."""
    set_torchrun_env(rank_, world, port)
    with init_distributed(backend="gloo", device="cpu"):
        hook = Emissions()
        data = DataLoader(make_data(seed=rank_), batch_size=8)
        ItemsTrainer(max_steps=6, gradient_accumulation_steps=2, data=data, rank_items=rank_, hooks=[hook]).train()
    torch.save([(s.step, s.throughput) for s in hook.emitted], os.path.join(out, f"rank{rank_}.pt"))
