"""Run under ``torchrun --nproc_per_node=2``: train a DDP EvalTrainer with sharded checkpoints, then evaluate.

Usage: ``eval_ddp_worker.py WORKSPACE OUT_DIR``; each rank writes ``OUT_DIR/rank<r>.json`` with its
training run's last validation and its evaluate run's metrics.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from eval_trainers import EvalTrainer
from tiny_trainer import make_data
from torch.utils.data import DataLoader, DistributedSampler

from trainloop.distributed import init_distributed, wrap_model
from trainloop.hooks.checkpointing import CheckpointingHook
from trainloop.hooks.validation import ValidationHook


class DDPEvalTrainer(EvalTrainer):
    """EvalTrainer wrapped by DDP, each rank drawing its shard."""

    def build_data_loader(self):
        data = make_data()
        return DataLoader(data, batch_size=8, sampler=DistributedSampler(data, seed=0))

    def build_model(self):
        return wrap_model(super().build_model(), "auto")


def hooks():
    return [ValidationHook("val_metrics", interval=2), CheckpointingHook(interval=2, format="sharded")]


def main() -> None:
    workspace, out = Path(sys.argv[1]), Path(sys.argv[2])
    with init_distributed(backend="gloo", device="cpu") as ctx:
        trained = DDPEvalTrainer(max_steps=4, workspace=workspace, seed=0, hooks=hooks()).train()
        evaluator = DDPEvalTrainer(max_steps=4, workspace=workspace, seed=0, hooks=hooks())
        metrics = evaluator.evaluate()
        record = {
            "world": ctx.world_size,
            "trained": trained.metrics["val/loss"],
            "evaluated": metrics,
            "kind": evaluator.result.kind,
            "path": [[e.source.value, e.dest.value] for e in evaluator.trace] if evaluator.trace else None,
        }
        (out / f"rank{ctx.rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
