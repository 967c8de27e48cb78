"""The training loops ``benchmarks/peers.py`` compares, one per library, run in a child process.

Run: ``python benchmarks/_peer_loops.py train <contender> <model> <steps> <warmup>`` prints one JSON
line ``{"seconds": ..., "steps": ..., "threads": ...}``: the CPU time (``time.process_time``) of
``steps`` training steps, measured on a second run after a complete warm-up run of ``warmup``
steps in the same process (kernels, allocator and each library's lazy imports are warm by then).
Only the loop is timed, not building the model or the library's setup.

``python benchmarks/_peer_loops.py syncs <contender> <model> <steps>`` prints ``{"syncs_per_step":
..., "steps": ...}``: host syncs (``_syncs.HostSyncs``, the count trainloop's own test makes) per
optimizer update in the steady state, from the end of the first ``SKIP_STEPS`` steps to the end of
the last one, so the once-per-run calls of start-up and shut-down are left out. This pass is
separate from the timed one: the counting wrappers cost time.

``python benchmarks/_peer_loops.py import <contender>`` prints ``{"total": ..., "beyond_torch":
...}``: wall seconds of ``import torch`` plus the library's import, and of the library's import
alone with torch already loaded.

Every contender does the same work per step: take the next of 64 in-memory batches (cycled
forever), forward, cross-entropy, backward, SGD step, zero the gradients. Each ``run_*`` takes an
optional ``after_step`` callable, called after every optimizer update through the library's own
per-step callback; only the counting pass passes one.
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from collections.abc import Callable, Iterator

from _syncs import syncs_per_step  # the script's own directory is on sys.path

MODELS = {
    # name: (layer widths, batch size)
    "tiny": ((32, 64, 64, 10), 32),
    "medium": ((256, 1024, 1024, 10), 128),
}
BATCHES = 64
SKIP_STEPS = 2  # steps the counting pass leaves out before its window (first-step lazy work)
AfterStep = Callable[[], None] | None

# What a user of each library imports to write the loop below.
IMPORTS = {
    "raw": "torch",
    "trainloop": "trainloop",
    "lightning": "lightning",
    "accelerate": "accelerate",
    "ignite": "ignite.engine",
    "transformers": "transformers.trainer",  # `import transformers` alone is lazy and loads no Trainer
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


def run_raw(model: str, steps: int, after_step: AfterStep = None) -> float:
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
        if after_step is not None:
            after_step()
    return time.process_time() - start


def run_trainloop(model: str, steps: int, after_step: AfterStep = None) -> float:
    """``BaseTrainer`` with default settings; returns CPU seconds of the loop."""
    import torch
    from torch import nn

    from trainloop import BaseTrainer
    from trainloop.hooks import BaseHook

    marks: dict[str, float] = {}

    class Timer(BaseHook):
        # Once-per-run methods: the trainer calls only overridden methods, so steps cost the same.
        def on_before_train(self, trainer):
            marks.setdefault("start", time.process_time())

        def on_after_train(self, trainer):
            marks.setdefault("end", time.process_time())

    class EveryStep(BaseHook):
        def on_after_step(self, trainer):
            after_step()

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

        def build_hooks(self):
            return [Timer()] + ([EveryStep()] if after_step is not None else [])

    PeerTrainer(max_steps=steps).train()
    return marks["end"] - marks["start"]


def _lightning():
    """``lightning.pytorch`` from either distribution (``lightning`` or ``pytorch-lightning``)."""
    try:
        import lightning.pytorch as pl
    except ImportError:
        import pytorch_lightning as pl
    return pl


def run_lightning(model: str, steps: int, after_step: AfterStep = None) -> float:
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

    class EveryStep(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            after_step()  # after the optimizer step under automatic optimization

    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[Timer()] + ([EveryStep()] if after_step is not None else []),
    )
    trainer.fit(PeerModule(), train_dataloaders=Batches(model))
    if trainer.global_step != steps:
        raise RuntimeError(f"lightning ran {trainer.global_step} steps, not {steps}")
    return marks["end"] - marks["start"]


def run_accelerate(model: str, steps: int, after_step: AfterStep = None) -> float:
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
        if after_step is not None:
            after_step()
    return time.process_time() - start


def run_ignite(model: str, steps: int, after_step: AfterStep = None) -> float:
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
    if after_step is not None:
        engine.add_event_handler(Events.ITERATION_COMPLETED, lambda e: after_step())
    engine.run(Batches(model), max_epochs=1, epoch_length=steps)
    if engine.state.iteration != steps:
        raise RuntimeError(f"ignite ran {engine.state.iteration} steps, not {steps}")
    return marks["end"] - marks["start"]


def run_transformers(model: str, steps: int, after_step: AfterStep = None) -> float:
    """Hugging Face ``Trainer.train`` with logging, saving, reporting and progress bar off.

    The Trainer feeds ``model(**batch)`` and takes the loss it returns, so the MLP is wrapped to
    return ``{"loss": ...}``. Its data loader draws one of the same pre-built batches at a time
    (a batch of one batch, unwrapped by the collator), so no contender pays for collating
    samples. Our SGD optimizer goes in through ``optimizers``; the Trainer still builds and steps
    its own scheduler, set to constant so the learning rate matches the other loops. Clipping is
    off like everywhere else (the Trainer still computes the gradient norm each step, for its
    logs: that is its own per-step work, left in).
    """
    import logging
    import tempfile
    import warnings

    import torch
    from torch import nn
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # its per-run notices are noise here
    logging.getLogger("accelerate").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")

    class LossMLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = make_model(model)

        def forward(self, x, labels):
            return {"loss": nn.functional.cross_entropy(self.net(x), labels)}

    class PeerBatches(torch.utils.data.IterableDataset):
        def __iter__(self):
            for x, y in Batches(model):
                yield {"x": x, "labels": y}

    marks: dict[str, float] = {}

    class Timer(TrainerCallback):
        def on_epoch_begin(self, args, state, control, **kwargs):
            marks.setdefault("start", time.process_time())

        def on_epoch_end(self, args, state, control, **kwargs):
            marks.setdefault("end", time.process_time())

    class EveryStep(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            after_step()  # after the optimizer and scheduler step and zero_grad

    net = LossMLP()
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out,
            max_steps=steps,
            per_device_train_batch_size=1,
            lr_scheduler_type="constant",
            max_grad_norm=0.0,
            report_to="none",
            save_strategy="no",
            logging_strategy="no",
            eval_strategy="no",
            disable_tqdm=True,
            use_cpu=True,
            dataloader_num_workers=0,
            dataloader_pin_memory=False,
        )
        trainer = Trainer(
            model=net,
            args=args,
            train_dataset=PeerBatches(),
            data_collator=lambda items: items[0],
            optimizers=(torch.optim.SGD(net.parameters(), lr=0.01), None),
            callbacks=[Timer()] + ([EveryStep()] if after_step is not None else []),
        )
        trainer.train()
    if trainer.state.global_step != steps:
        raise RuntimeError(f"transformers ran {trainer.state.global_step} steps, not {steps}")
    return marks["end"] - marks["start"]


RUNS: dict[str, Callable[..., float]] = {
    "raw": run_raw,
    "trainloop": run_trainloop,
    "lightning": run_lightning,
    "accelerate": run_accelerate,
    "ignite": run_ignite,
    "transformers": run_transformers,
}


def _train(contender: str, model: str, steps: int, warmup: int) -> dict:
    import torch

    torch.set_num_threads(1)
    run = RUNS[contender]
    if warmup:
        run(model, warmup)
    seconds = run(model, steps)
    return {"seconds": seconds, "steps": steps, "threads": torch.get_num_threads()}


def _syncs(contender: str, model: str, steps: int) -> dict:
    import torch

    torch.set_num_threads(1)
    return syncs_per_step(lambda after_step: RUNS[contender](model, steps, after_step), steps, SKIP_STEPS)


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
    elif argv[:1] == ["syncs"] and len(argv) == 4:
        result = _syncs(argv[1], argv[2], int(argv[3]))
    elif argv[:1] == ["import"] and len(argv) == 2:
        result = _import(argv[1])
    else:
        raise SystemExit(
            "usage: _peer_loops.py train CONTENDER MODEL STEPS WARMUP | syncs CONTENDER MODEL STEPS | import CONTENDER"
        )
    # Libraries may print on stdout; the parent reads the last line only.
    sys.stdout.write("\n" + json.dumps(result) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
