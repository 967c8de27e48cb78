"""A worker of tests/hooks/test_profiler.py's two-rank run (spawned, so importable by module name).

Each worker plays one torchrun process: a DDP-wrapped ``TinyTrainer`` under gloo with a declared
``ProfilerHook`` (steps 2-3 recorded) writing into one shared workspace.
"""

from __future__ import annotations

import os
from pathlib import Path

from dist_workers import set_torchrun_env
from tiny_trainer import TinyTrainer, make_data
from torch.utils.data import DataLoader

from trainloop.distributed import init_distributed, wrap_model
from trainloop.hooks import ProfilerHook


class DDPTinyTrainer(TinyTrainer):
    def build_model(self):
        return wrap_model(super().build_model(), "ddp")


def profiled_ranks(rank_: int, world: int, port: int, out: str) -> None:
    """Train 4 steps with the profiler declared; write the hook's trace paths to ``<out>/rank<r>.txt``."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    set_torchrun_env(rank_, world, port)
    with init_distributed(backend="gloo", device="cpu"):
        trainer = DDPTinyTrainer(
            max_steps=4, workspace=Path(out) / "ws", data=DataLoader(make_data(seed=rank_), batch_size=8),
            hooks=[ProfilerHook(wait=0, warmup=1, active=2)], metrics_file=False,
        )
        trainer.train()
        hook = next(h for h in trainer.hooks if isinstance(h, ProfilerHook))
    (Path(out) / f"rank{rank_}.txt").write_text("\n".join(str(p) for p in hook.traces))
