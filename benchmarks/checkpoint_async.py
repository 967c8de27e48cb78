"""How long a checkpoint blocks the training loop: synchronous saves vs background saves.

An MLP of about 25M float32 parameters (~100 MB; SGD with momentum, so the checkpoint holds
twice that) trains on random data on the CPU, and ``CheckpointingHook`` saves every
``--interval`` steps, in each format, with ``async_save`` off and on. The time the loop spends
in the ``checkpointing`` state (wall clock, from entering it to leaving it) is the time it is
blocked: the whole write for a synchronous save, the copy to CPU memory for a background one.
Medians over ``--saves`` saves per configuration; the first save of each run is left out (it
pays for first-call set-up). The checkpoints go to a temporary directory (or ``--dir``).

``--momentum 0`` makes the checkpoint the model's size, but then every
``trainer.state_dict()`` pays for ``get_state_dict`` initialising the (empty) optimizer state
with a zero-gradient step (~50 ms here), which a stateful optimizer does not.

Run: ``python benchmarks/checkpoint_async.py [--saves 5] [--interval 8] [--momentum 0.9]``
"""

from __future__ import annotations

import argparse
import itertools
import logging
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from trainloop import BaseTrainer, State
from trainloop.hooks.checkpointing import CheckpointingHook

WIDTH = 4096


class BenchTrainer(BaseTrainer):
    """A 4096-4096-2048 MLP (25.2M parameters) regressed on fixed random batches."""

    def __init__(self, *args, hooks=(), momentum=0.9, **kwargs):
        super().__init__(*args, **kwargs)
        self._hooks = list(hooks)
        self.momentum = momentum

    def build_data_loader(self):
        g = torch.Generator().manual_seed(0)
        batches = [(torch.randn(16, WIDTH, generator=g), torch.randn(16, WIDTH // 2, generator=g)) for _ in range(4)]
        return itertools.cycle(batches)

    def build_model(self):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH // 2))

    def build_optimizer(self):
        return torch.optim.SGD(self.model.parameters(), lr=1e-4, momentum=self.momentum)

    def build_hooks(self):
        return self._hooks

    def forward(self, batch):
        x, y = batch
        return nn.functional.mse_loss(self.model(x), y), {}


def blocked_per_save(
    directory: Path, format: str, async_save: bool, saves: int, interval: int, momentum: float
) -> tuple[list[float], float]:
    """Seconds the loop spent in ``checkpointing`` per save, and the checkpoint's size in MB."""
    hook = CheckpointingHook(interval=interval, path=directory, load=None, format=format, async_save=async_save)
    trainer = BenchTrainer(max_steps=interval * (saves + 1), hooks=[hook], momentum=momentum)
    entered: list[float] = []
    blocked: list[float] = []
    trainer.on_enter(State.CHECKPOINTING, lambda t: entered.append(time.perf_counter()))
    trainer.on_exit(State.CHECKPOINTING, lambda t: blocked.append(time.perf_counter() - entered[-1]))
    trainer.train()
    size = sum(p.stat().st_size for p in (directory / "latest").resolve().rglob("*") if p.is_file())
    return blocked[1:], size / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--saves", type=int, default=5, help="measured saves per configuration")
    parser.add_argument("--interval", type=int, default=8, help="training steps between saves")
    parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (0: no optimizer state)")
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    logging.getLogger("trainloop").setLevel(logging.WARNING)
    params = sum(p.numel() for p in BenchTrainer(max_steps=1).build_model().parameters())
    print(f"model: {params / 1e6:.1f}M float32 parameters ({params * 4 / 1e6:.0f} MB); "
          f"SGD momentum {args.momentum}; {args.saves} saves per row, every {args.interval} steps; "
          f"torch {torch.__version__}")
    print(f"{'format':<8} {'mode':<6} {'checkpoint':>10} {'blocked, median':>16} {'min':>8} {'max':>8} {'vs sync':>8}")
    with tempfile.TemporaryDirectory(dir=args.dir) as scratch:
        for format in ("full", "sharded"):
            sync_median = None
            for async_save in (False, True):
                directory = Path(scratch) / f"{format}-{'async' if async_save else 'sync'}"
                blocked, size = blocked_per_save(
                    directory, format, async_save, args.saves, args.interval, args.momentum
                )
                median = statistics.median(blocked)
                sync_median = sync_median or median
                ratio = f"{100 * median / sync_median:.0f}%"
                print(f"{format:<8} {'async' if async_save else 'sync':<6} {size:>7.0f} MB {1000 * median:>13.0f} ms "
                      f"{1000 * min(blocked):>5.0f} ms {1000 * max(blocked):>5.0f} ms {ratio:>8}")


if __name__ == "__main__":
    main()
