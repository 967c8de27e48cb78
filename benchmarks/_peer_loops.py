"""The training loops ``benchmarks/peers.py`` compares, one per library, run in a child process.

Run: ``python benchmarks/_peer_loops.py train <contender> <model> <steps> <warmup>`` prints one JSON
line ``{"seconds": ..., "steps": ..., "threads": ...}``: the CPU time (``time.process_time``) of
``steps`` training steps, measured on a second run after a complete warm-up run of ``warmup``
steps in the same process (kernels, allocator and each library's lazy imports are warm by then).
Only the loop is timed, not building the model or the library's setup.

``python benchmarks/_peer_loops.py import <contender>`` prints ``{"total": ..., "beyond_torch":
...}``: wall seconds of ``import torch`` plus the library's import, and of the library's import
alone with torch already loaded.

Every contender does the same work per step: take the next of 64 in-memory batches (cycled
forever), forward, cross-entropy, backward, SGD step, zero the gradients.
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from collections.abc import Callable, Iterator

MODELS = {
    # name: (layer widths, batch size)
    "tiny": ((32, 64, 64, 10), 32),
    "medium": ((256, 1024, 1024, 10), 128),
}
BATCHES = 64

# What a user of each library imports to write the loop below.
IMPORTS = {
    "raw": "torch",
    "trainloop": "trainloop",
    "lightning": "lightning",
    "accelerate": "accelerate",
    "ignite": "ignite.engine",
}


def make_model(model: str):
    """The MLP named ``model``, initialised identically in every process."""
    import torch
    from torch import nn

    widths, _ = MODELS[model]
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i, (n_in, n_out) in enumerate(itertools.pairwise(widths)):
        if i:
            layers.append(nn.ReLU())
        layers.append(nn.Linear(n_in, n_out))
    return nn.Sequential(*layers)


class Batches:
    """An endless iterable over the same in-memory batches (no ``__len__``: no epoch ends)."""

    def __init__(self, model: str):
        import torch

        widths, batch_size = MODELS[model]
        g = torch.Generator().manual_seed(0)
        self.items = [
            (torch.randn(batch_size, widths[0], generator=g), torch.randint(0, widths[-1], (batch_size,), generator=g))
            for _ in range(BATCHES)
        ]

    def __iter__(self) -> Iterator:
        while True:
            yield from self.items


def run_raw(model: str, steps: int) -> float:
    """The hand-written loop; returns CPU seconds."""
    import torch
    from torch import nn

    net = make_model(model)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    data = iter(Batches(model))
    start = time.process_time()
    for _ in range(steps):
        x, y = next(data)
        loss = nn.functional.cross_entropy(net(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return time.process_time() - start


def run_trainloop(model: str, steps: int) -> float:
    """``BaseTrainer`` with default settings; returns CPU seconds of the loop."""
    import torch
    from torch import nn

    from trainloop import BaseTrainer, State

    class PeerTrainer(BaseTrainer):
        def build_data_loader(self):
            return Batches(model)

        def build_model(self):
            return make_model(model)

        def build_optimizer(self):
            return torch.optim.SGD(self.model.parameters(), lr=0.01)

        def forward(self, batch):
            x, y = batch
            return nn.functional.cross_entropy(self.model(x), y), {}

    trainer = PeerTrainer(max_steps=steps)
    marks: dict[str, float] = {}
    # Once-per-run edges: listening to them leaves the per-step path untouched.
    trainer.on_transition(State.RESTORING, State.ACCUMULATING, lambda t: marks.setdefault("start", time.process_time()))
    trainer.on_enter(State.EXITING, lambda t: marks.setdefault("end", time.process_time()))
    trainer.train()
    return marks["end"] - marks["start"]


def _lightning():
    """``lightning.pytorch`` from either distribution (``lightning`` or ``pytorch-lightning``)."""
    try:
        import lightning.pytorch as pl
    except ImportError:
        import pytorch_lightning as pl
    return pl


def run_lightning(model: str, steps: int) -> float:
    """``Trainer.fit`` with logger, checkpointing, progress bar and summary off."""
    import logging
    import warnings

    import torch
    from torch import nn

    pl = _lightning()
    # Its per-run info lines ("GPU available: False ...") and the no-__len__ warning are noise here.
    for name in ("lightning", "lightning.pytorch", "pytorch_lightning", "lightning.fabric", "lightning_fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")

    class PeerModule(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = make_model(model)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    marks: dict[str, float] = {}

    class Timer(pl.Callback):
        def on_train_epoch_start(self, trainer, pl_module):
            marks.setdefault("start", time.process_time())

        def on_train_end(self, trainer, pl_module):
            marks.setdefault("end", time.process_time())

    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[Timer()],
    )
    trainer.fit(PeerModule(), train_dataloaders=Batches(model))
    if trainer.global_step != steps:
        raise RuntimeError(f"lightning ran {trainer.global_step} steps, not {steps}")
    return marks["end"] - marks["start"]


def run_accelerate(model: str, steps: int) -> float:
    """``Accelerator().prepare`` on model and optimizer, then a plain loop with ``backward``."""
    import torch
    from accelerate import Accelerator
    from torch import nn

    accelerator = Accelerator(cpu=True)
    net = make_model(model)
    net, optimizer = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.01))
    data = iter(Batches(model))
    start = time.process_time()
    for _ in range(steps):
        x, y = next(data)
        loss = nn.functional.cross_entropy(net(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    return time.process_time() - start


def run_ignite(model: str, steps: int) -> float:
    """``create_supervised_trainer`` run for one epoch of ``steps`` iterations."""
    import torch
    from ignite.engine import Events, create_supervised_trainer
    from torch import nn

    net = make_model(model)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    engine = create_supervised_trainer(net, optimizer, nn.functional.cross_entropy, device="cpu")
    marks: dict[str, float] = {}
    engine.add_event_handler(Events.EPOCH_STARTED, lambda e: marks.setdefault("start", time.process_time()))
    engine.add_event_handler(Events.EPOCH_COMPLETED, lambda e: marks.setdefault("end", time.process_time()))
    engine.run(Batches(model), max_epochs=1, epoch_length=steps)
    if engine.state.iteration != steps:
        raise RuntimeError(f"ignite ran {engine.state.iteration} steps, not {steps}")
    return marks["end"] - marks["start"]


RUNS: dict[str, Callable[[str, int], float]] = {
    "raw": run_raw,
    "trainloop": run_trainloop,
    "lightning": run_lightning,
    "accelerate": run_accelerate,
    "ignite": run_ignite,
}


def _train(contender: str, model: str, steps: int, warmup: int) -> dict:
    import torch

    torch.set_num_threads(1)
    run = RUNS[contender]
    if warmup:
        run(model, warmup)
    seconds = run(model, steps)
    return {"seconds": seconds, "steps": steps, "threads": torch.get_num_threads()}


def _import(contender: str) -> dict:
    import importlib

    start = time.perf_counter()
    importlib.import_module("torch")
    torch_done = time.perf_counter()
    module = IMPORTS[contender]
    if contender == "lightning":
        try:
            importlib.import_module(module)
        except ImportError:
            importlib.import_module("pytorch_lightning")
    else:
        importlib.import_module(module)
    end = time.perf_counter()
    return {"total": end - start, "beyond_torch": end - torch_done}


def main(argv: list[str]) -> None:
    """Entry point of the child process; see the module docstring for the arguments."""
    if argv[:1] == ["train"] and len(argv) == 5:
        result = _train(argv[1], argv[2], int(argv[3]), int(argv[4]))
    elif argv[:1] == ["import"] and len(argv) == 2:
        result = _import(argv[1])
    else:
        raise SystemExit("usage: _peer_loops.py train CONTENDER MODEL STEPS WARMUP | import CONTENDER")
    # Libraries may print on stdout; the parent reads the last line only.
    sys.stdout.write("\n" + json.dumps(result) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
