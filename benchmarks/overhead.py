"""What ``BaseTrainer.train()`` adds to a hand-written loop, per step.

The same tiny MLP (32-64-64-10, batch 32, SGD, CPU, one thread) is trained for ``--steps``
steps by a plain loop and by trainers in several configurations, interleaved round by round in
one process. Each configuration's CPU time (``time.process_time``) is divided by the raw loop's
of the same round, and the median ratio over rounds is reported: this machine is noisy (±10%
run to run), and ratios taken side by side cancel most of it.

Two configurations train with ``SGD(fused=True)``, the non-finite check on and off: their ratio
is what the check costs where the optimizer skips a non-finite update in its own kernel.

The last two configurations return ``Loss(sum, count)`` (the count a tensor, as a masked
token count would be) with the progress and logging hooks on: one counts the items for the
throughput as the hooks do, the other has the counting stubbed out, so their ratio is what
counting costs.

Run: ``python benchmarks/overhead.py [--steps 500] [--rounds 15]``
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from trainloop import BaseHook, BaseTrainer, Loss, State

BATCHES = 64


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def make_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(32, 32, generator=g), torch.randint(0, 10, (32,), generator=g)) for _ in range(BATCHES)]


def raw_loop(steps: int, batches: list) -> float:
    """The hand-written loop every trainer is compared with; returns CPU seconds."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = itertools.cycle(batches)
    start = time.process_time()
    for _ in range(steps):
        x, y = next(data)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return time.process_time() - start


class BenchTrainer(BaseTrainer):
    """The raw loop's work, as a trainer."""

    batches: list = []
    count_items = False  # return Loss(sum, count) with a tensor count instead of a mean
    fused = False  # SGD(fused=True): the optimizer skips a non-finite update in its kernel

    def __init__(self, *args, hooks=(), **kwargs):
        super().__init__(*args, **kwargs)
        self._hooks = list(hooks)

    def build_hooks(self):
        return self._hooks

    def build_data_loader(self):
        return itertools.cycle(self.batches)

    def build_model(self):
        return make_model()

    def build_optimizer(self):
        return torch.optim.SGD(self.model.parameters(), lr=0.01, fused=self.fused or None)

    def forward(self, batch):
        x, y = batch
        if self.count_items:
            count = torch.tensor(len(y))  # as a masked token count would be: a tensor
            return Loss(nn.functional.cross_entropy(self.model(x), y, reduction="sum"), count), {}
        return nn.functional.cross_entropy(self.model(x), y), {}


def trainer_loop(steps: int, batches: list, **settings) -> float:
    """Train with ``BaseTrainer``; returns the CPU seconds of the loop (building excluded)."""
    BenchTrainer.batches = batches
    trainer = BenchTrainer(max_steps=steps, **settings)
    marks: dict[str, float] = {}
    # These two edges fire once per run, so listening to them leaves the hot edges fast.
    trainer.on_transition(State.RESTORING, State.ACCUMULATING, lambda t: marks.setdefault("start", time.process_time()))
    trainer.on_enter(State.EXITING, lambda t: marks.setdefault("end", time.process_time()))
    trainer.train()
    return marks["end"] - marks["start"]


def fused_trainer_loop(steps: int, batches: list, **settings) -> float:
    """``trainer_loop`` with ``SGD(fused=True)``: the non-finite check decided on the device."""
    BenchTrainer.fused = True
    try:
        return trainer_loop(steps, batches, **settings)
    finally:
        BenchTrainer.fused = False


def hooked_trainer_loop(steps: int, batches: list, count_items: bool = False, counting: bool = True) -> float:
    """``trainer_loop`` with ``ProgressHook(interval=100)`` and ``LoggingHook(interval=100)``.

    Their lines go to a ``NullHandler`` logger so they don't flood the report. With
    ``count_items``, ``forward`` returns ``Loss(sum, count)``; without ``counting``, the hooks'
    item counting is stubbed out (the one difference between the last two configurations).
    """
    from trainloop.hooks.logging_hook import LoggingHook
    from trainloop.hooks.progress import ProgressHook

    logger = logging.getLogger("benchmarks.overhead.quiet")
    if not logger.handlers:
        logger.addHandler(logging.NullHandler())
        logger.propagate = False
        logger.setLevel(logging.INFO)
    hooks = [ProgressHook(interval=100), LoggingHook(interval=100)]
    if not counting:
        for hook in hooks:
            hook._items.add = lambda info, trainer: None  # type: ignore[method-assign]  # benchmark only
    BenchTrainer.count_items = count_items
    try:
        return trainer_loop(steps, batches, hooks=hooks, logger=logger)
    finally:
        BenchTrainer.count_items = False


def validated_trainer_loop(steps: int, batches: list) -> float:
    """``trainer_loop`` with a ``ValidationHook`` that is never due in the run: what ``validation_due`` costs."""
    from trainloop.hooks.validation import ValidationHook

    hooks = [ValidationHook(lambda t: {"loss": 0.0}, interval=10**9, at_last_step=False)]
    return trainer_loop(steps, batches, hooks=hooks)


class StartAtStep3(BaseHook):
    """Marks the CPU time at which step 3 begins (its ``on_before_step``)."""

    def __init__(self, marks: dict[str, float]) -> None:
        self.marks = marks

    def on_before_step(self, trainer: BaseTrainer) -> None:
        if trainer.step == 3:
            self.marks["start"] = time.process_time()


def after_two_steps(steps: int, batches: list, profiler: bool = False) -> float:
    """Train ``steps + 2`` steps, the last ``steps`` timed; with ``profiler``, a ``ProfilerHook`` profiles steps 1-2.

    The pair, side by side, is what the profiler costs a run once its window is over.
    """
    import tempfile

    from trainloop.hooks.profiler import ProfilerHook

    BenchTrainer.batches = batches
    marks: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as traces:
        hooks: list[BaseHook] = [StartAtStep3(marks)]
        if profiler:
            hooks.insert(0, ProfilerHook(wait=0, warmup=1, active=1, trace_dir=Path(traces), top=0))
        trainer = BenchTrainer(max_steps=steps + 2, hooks=hooks, logger=logging.getLogger("benchmarks.overhead.quiet"))
        trainer.on_enter(State.EXITING, lambda t: marks.setdefault("end", time.process_time()))
        trainer.train()
    return marks["end"] - marks["start"]


CONFIGS: dict[str, Callable[[int, list], float]] = {
    "raw loop again (noise floor)": raw_loop,
    "trainer (defaults: non-finite check on)": lambda n, b: trainer_loop(n, b),
    "trainer (non-finite check off)": lambda n, b: trainer_loop(n, b, detect_non_finite_grads=False),
    "trainer, fused SGD (non-finite check on)": lambda n, b: fused_trainer_loop(n, b),
    "trainer, fused SGD (non-finite check off)": lambda n, b: fused_trainer_loop(n, b, detect_non_finite_grads=False),
    "trainer (trace on)": lambda n, b: trainer_loop(n, b, trace=True),
    "trainer + progress + logging hooks (interval 100)": hooked_trainer_loop,
    "trainer + validation hook (never due)": validated_trainer_loop,
    "trainer from step 3 (profiler's baseline)": after_two_steps,
    "trainer + profiler, window (1-2) over": lambda n, b: after_two_steps(n, b, profiler=True),
    "  same, Loss(sum, count), items counted": lambda n, b: hooked_trainer_loop(n, b, count_items=True),
    "  same, Loss(sum, count), counting stubbed out": lambda n, b: hooked_trainer_loop(
        n, b, count_items=True, counting=False
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    batches = make_batches()
    raw_loop(100, batches)  # warm up allocator and kernels
    for run in CONFIGS.values():
        run(100, batches)
    ratios: dict[str, list[float]] = {name: [] for name in CONFIGS}
    raw_times = []
    contestants = [("raw", raw_loop), *CONFIGS.items()]
    for round_ in range(args.rounds):
        # Rotate the order each round so no contestant always runs first or last.
        shift = round_ % len(contestants)
        times = {name: run(args.steps, batches) for name, run in contestants[shift:] + contestants[:shift]}
        raw_times.append(times["raw"])
        for name in CONFIGS:
            ratios[name].append(times[name] / times["raw"])
    raw_us = statistics.median(raw_times) / args.steps * 1e6
    print(f"raw loop: {raw_us:.0f} µs/step (median of {args.rounds} rounds of {args.steps} steps)")
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for name, values in ratios.items():
        median = statistics.median(values)
        print(f"{name:50s} ratio {median:.3f}  (+{(median - 1) * raw_us:.0f} µs/step)")
    counted = ratios["  same, Loss(sum, count), items counted"]
    stubbed = ratios["  same, Loss(sum, count), counting stubbed out"]
    paired = statistics.median(c / s for c, s in zip(counted, stubbed, strict=True))
    print(f"item counting, counted / stubbed out, paired by round: ratio {paired:.3f}")


if __name__ == "__main__":
    main()
