"""trainloop on a GPU against a hand-written loop: ms per step, and what an async checkpoint blocks.

The model is GPT-2 small's shape (12 layers, width 768, 12 heads, block 1024, vocabulary 50304,
tied embeddings), compiled with ``torch.compile``, trained in bf16 autocast with fused AdamW and
gradient clipping at 1.0, on batches of 16 sequences of random tokens made once, the same for
every loop. Three loops run in this one process, each on a model of its own:

- ``hand``: a plain loop (forward, backward, clip, step, zero_grad), nanoGPT's;
- ``trainloop``: the same model, optimizer and batches through ``BaseTrainer`` with its
  defaults (the non-finite-gradient guard on);
- ``trainloop, guard off``: ``detect_non_finite_grads=False``.

Time is taken inside the process between two synchronised points (``torch.cuda.synchronize()``
before the first measured step and after the last), after ``--warmup`` steps that compile and
warm up: whole-process wall time would include compilation, which varies by tens of seconds.
Each loop runs ``--rounds`` times, interleaved; the median round is reported.

Then checkpoints: trainloop runs that save every ``--save-every`` steps (async full, async
sharded, synchronous full) against the same run without saves. What a save blocks is the
extra time per save between the synchronised points; beside it, the time to copy the same
state (model and AdamW moments) from the GPU into pinned host memory allocated beforehand,
which issue 27 bounds it by (at most 2x).

Without a CUDA device it says so and exits 0. Prints a table; ``--json PATH`` writes the figures
with the card and versions.

One save is in flight at most: a save due while the last one is still being written waits for it, so
saves closer together than the disk writes the state measure the disk, not the loop (1.4 GiB
saved every 10 steps of 34 ms on an H200 blocked each save ~1 s that way). The default spacing
leaves the write time to finish.

Run: ``python benchmarks/gpu.py [--steps 100] [--warmup 10] [--rounds 3] [--save-every 50] [--json out.json]``
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

VOCAB = 50304  # GPT-2's 50257, padded to a multiple of 64 as nanoGPT does


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a 4x MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(approximate="tanh"), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).contiguous().view(batch, length, width))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2's architecture at a given size; ``forward(tokens, targets)`` returns the mean cross-entropy."""

    def __init__(self, layers: int, width: int, heads: int, block: int) -> None:
        super().__init__()
        self.token = nn.Embedding(VOCAB, width)
        self.position = nn.Embedding(block, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB, bias=False)
        self.head.weight = self.token.weight  # tied, as GPT-2

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.token(tokens) + self.position(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), targets.view(-1))


def build(args: argparse.Namespace) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model (seeded: every loop starts from the same weights), compiled, and its fused AdamW."""
    torch.manual_seed(0)
    model = GPT(args.layers, args.width, args.heads, args.block).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    return torch.compile(model), optimizer


def make_batches(args: argparse.Namespace, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` batches of random tokens on the GPU, made once (inputs and next-token targets)."""
    generator = torch.Generator(device="cuda").manual_seed(1)
    batches = []
    for _ in range(count):
        tokens = torch.randint(VOCAB, (args.batch, args.block + 1), device="cuda", generator=generator)
        batches.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return batches


class Clock:
    """Seconds between two synchronised points: after warm-up steps, and after the measured ones."""

    def __init__(self, warmup: int, steps: int) -> None:
        self.warmup, self.steps = warmup, steps
        self.start = self.seconds = 0.0

    def before(self, step: int) -> None:
        if step == self.warmup + 1:  # steps are counted from 1
            torch.cuda.synchronize()
            self.start = time.perf_counter()

    def after(self, step: int) -> None:
        if step == self.warmup + self.steps:
            torch.cuda.synchronize()
            self.seconds = time.perf_counter() - self.start


def hand_loop(args: argparse.Namespace, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Seconds for the measured steps of the plain loop."""
    model, optimizer = build(args)
    clock = Clock(args.warmup, args.steps)
    for step, (x, y) in enumerate(batches, start=1):
        clock.before(step)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        clock.after(step)
    return clock.seconds


def trainloop_loop(
    args: argparse.Namespace,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    guard: bool = True,
    checkpointing: dict[str, Any] | None = None,
    workspace: Path | None = None,
) -> tuple[float, float]:
    """Seconds for the measured steps through ``BaseTrainer``, and seconds spent in ``checkpointing`` then."""
    from trainloop import BaseHook, BaseTrainer, State
    from trainloop.hooks.checkpointing import CheckpointingHook

    clock = Clock(args.warmup, args.steps)
    entered: list[float] = []
    in_checkpointing = [0.0]

    class Timed(BaseHook):
        def on_before_step(self, trainer: Any) -> None:
            clock.before(trainer.step)

        def on_after_step(self, trainer: Any) -> None:
            clock.after(trainer.step)

    class Bench(BaseTrainer):
        def build_data_loader(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
            return iter(batches)

        def build_model(self) -> nn.Module:
            self._built = build(args)
            return self._built[0]

        def build_optimizer(self) -> torch.optim.Optimizer:
            return self._built[1]

        def build_hooks(self) -> list[BaseHook]:
            hooks: list[BaseHook] = [Timed()]
            if checkpointing is not None:
                hooks.append(CheckpointingHook(interval=args.save_every, keep_previous=0, load=None, **checkpointing))
            return hooks

        def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, dict[str, Any]]:
            return self.model(*batch), {}

    trainer = Bench(
        max_steps=len(batches), device="cuda", mixed_precision="bf16", grad_clip=1.0,
        detect_non_finite_grads=guard, workspace=workspace, metrics_file=False,
    )  # fmt: skip
    # The saves inside the measured window: the last measured step's save runs after the window closes.
    measured = range(args.warmup + 1, args.warmup + args.steps)
    trainer.on_enter(State.CHECKPOINTING, lambda t: entered.append(time.perf_counter()) if t.step in measured else None)

    def left(t: Any) -> None:
        if entered and t.step in measured:
            in_checkpointing[0] += time.perf_counter() - entered.pop()

    trainer.on_exit(State.CHECKPOINTING, left)
    trainer.train()
    return clock.seconds, in_checkpointing[0]


def pinned_copy_seconds(args: argparse.Namespace) -> tuple[float, int]:
    """Seconds to copy the model's and AdamW's state from the GPU into pinned memory made beforehand; its bytes."""
    model, optimizer = build(args)
    x = torch.randint(VOCAB, (args.batch, args.block), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        model(x, x).backward()
    optimizer.step()  # the moments exist
    tensors = [p.detach() for p in model.parameters()]
    tensors += [t for state in optimizer.state.values() for t in state.values() if t.is_cuda]
    pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    times = []
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for buffer, tensor in zip(pinned, tensors, strict=True):
            buffer.copy_(tensor, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return min(times), sum(t.numel() * t.element_size() for t in tensors)


def median_ms(run: Callable[[], float], rounds: int, steps: int) -> float:
    return statistics.median(run() for _ in range(rounds)) / steps * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="measured steps per loop")
    parser.add_argument("--warmup", type=int, default=10, help="steps before the measured ones (compilation)")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each loop; the median is reported")
    parser.add_argument("--save-every", type=int, default=50, help="steps between checkpoints")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--block", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/gpu.py: no CUDA device here, nothing measured (run it on a machine with a GPU)")
        return 0
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    batches = make_batches(args, args.warmup + args.steps)
    loops: dict[str, Callable[[], float]] = {
        "hand": lambda: hand_loop(args, batches),
        "trainloop": lambda: trainloop_loop(args, batches)[0],
        "trainloop, guard off": lambda: trainloop_loop(args, batches, guard=False)[0],
    }
    seconds: dict[str, list[float]] = {name: [] for name in loops}
    for _ in range(args.rounds):  # interleaved: the card's clocks drift alike for every loop
        for name, run in loops.items():
            seconds[name].append(run())
    ms = {name: statistics.median(values) / args.steps * 1e3 for name, values in seconds.items()}
    figures: dict[str, Any] = {
        "card": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "shape": {k: getattr(args, k) for k in ("layers", "width", "heads", "block", "batch")},
        "ms_per_step": ms,
    }
    print(f"{figures['card']}, torch {figures['torch']}, CUDA {figures['cuda']}; "
          f"{args.steps} steps after {args.warmup}, median of {args.rounds} rounds")
    for name, value in ms.items():
        print(f"  {name:<22} {value:8.2f} ms/step  {value / ms['hand']:.3f}x hand")
    print(f"  guard on / guard off   {ms['trainloop'] / ms['trainloop, guard off']:.3f}x")

    copy_s, state_bytes = pinned_copy_seconds(args)
    saves = args.steps // args.save_every
    blocking: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        base = statistics.median(trainloop_loop(args, batches)[0] for _ in range(args.rounds))
        for label, options in (
            ("async full", {"format": "full", "async_save": True}),
            ("async sharded", {"format": "sharded", "async_save": True}),
            ("sync full", {"format": "full", "async_save": False}),
        ):
            runs = [trainloop_loop(args, batches, checkpointing=options, workspace=Path(scratch) / f"{label}{i}")
                    for i in range(args.rounds)]
            total, state_time = sorted(runs)[len(runs) // 2]
            blocking[label] = {"extra_ms_per_save": (total - base) / saves * 1e3,
                               "checkpointing_ms_per_save": state_time / saves * 1e3}
    figures["checkpoint"] = {"state_gib": state_bytes / 2**30, "pinned_copy_ms": copy_s * 1e3, "saves": saves,
                             "blocking": blocking}
    print(f"checkpoints: {state_bytes / 2**30:.2f} GiB of state; copy into pinned memory {copy_s * 1e3:.1f} ms; "
          f"{saves} saves in the measured steps")
    for label, values in blocking.items():
        extra = values["extra_ms_per_save"]
        ratio = f"{extra / (copy_s * 1e3):.2f}x the pinned copy" if not label.startswith("sync") else ""
        inside = values["checkpointing_ms_per_save"]
        print(f"  {label:<14} blocks {extra:8.1f} ms per save (in checkpointing {inside:.1f} ms)  {ratio}")
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0 if all(math.isfinite(v) for v in ms.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
