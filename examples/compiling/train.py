"""Train a ``torch.compile``d model with trainloop, and see which steps were spent compiling.

    python examples/compiling/train.py                  # workspace runs/compiling
    python examples/compiling/train.py runs/elsewhere   # or your own

The model is compiled in ``build_model`` (CPU inductor works; the first compilation takes a
while). From the 5th step on the batches hold 3 samples instead of 2, so dynamo recompiles once,
and says why. The run logs both compilations, marks their steps in ``trace.jsonl`` and
``metrics.jsonl`` (``compile_steps``, ``compile_time``, ``recompilations``), and leaves them out
of ``step_time``, the throughput and the ETA. The checkpoint's keys are the model's own (no
``_orig_mod.``). See ``docs/compiling.md``.
"""

from __future__ import annotations

import itertools
import logging
import sys
from pathlib import Path

import torch
from torch import nn

from trainloop import BaseTrainer, Loss
from trainloop.hooks import CheckpointingHook, LoggingHook, ProgressHook


class CompiledTrainer(BaseTrainer):
    """A 4-8-1 MLP, compiled, regressed on random batches of 2 samples, then 3 from step 5 on."""

    def build_data_loader(self):
        g = torch.Generator().manual_seed(0)

        def batch(size: int) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.randn(size, 4, generator=g), torch.randn(size, 1, generator=g)

        return itertools.chain((batch(2) for _ in range(4)), (batch(3) for _ in itertools.count()))

    def build_model(self):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        # Compile here, last: trainloop sees through the wrapper for checkpoints and exports.
        return torch.compile(model)

    def build_optimizer(self):
        return torch.optim.SGD(self.model.parameters(), lr=0.05)

    def build_hooks(self):
        return [
            ProgressHook(interval=4, bar=False, eta_warmup=0),
            LoggingHook(interval=4),
            CheckpointingHook(interval=8),
        ]

    def forward(self, batch):
        x, y = batch
        errors = (self.model(x) - y).pow(2).sum()
        return Loss(errors, len(x)), {}  # the count makes the throughput: samples per second


def main() -> None:
    """Train 8 steps in the workspace given (default ``runs/compiling``)."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    workspace = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("runs/compiling")
    trainer = CompiledTrainer(max_steps=8, workspace=workspace, trace=True)
    trainer.train()
    for mark in trainer.trace.compiled:
        print(mark.describe())


if __name__ == "__main__":
    main()
