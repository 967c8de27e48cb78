"""DeepSpeed under trainloop against the hand-written engine loop: time per step and peak memory, per ZeRO stage.

One process (a group of one rank), a small transformer in bf16 with a torch AdamW, the same config both ways. The
hand-written loop is ``engine(x)`` / ``engine.backward(loss)`` / ``engine.step()``; trainloop's is a trainer whose
settings declare ``deepspeed``. Prints one line per stage and way: the median step time over the timed steps (after
warm-up) and, on CUDA, the peak memory allocated. Run it as ``python benchmarks/deepspeed_step.py`` (CPU: with
``DS_ACCELERATOR=cpu``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainloop import BaseHook, BaseTrainer


class Transformer(nn.Module):
    def __init__(self, vocab: int, width: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(width, 8, 4 * width, dropout=0.0, batch_first=True) for _ in range(layers)
        )
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, is_causal=False)
        return self.head(x)


def batches(args: argparse.Namespace, device: torch.device) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [
        torch.randint(args.vocab, (args.batch, args.seq + 1), generator=generator).to(device)
        for _ in range(args.steps)
    ]


def loss_of(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


def config(stage: int) -> dict[str, Any]:
    return {"zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}


class Batches:
    """The batches made up front, with the ``batch_size`` DeepSpeed is told as its micro batch."""

    def __init__(self, data: list[torch.Tensor], batch_size: int) -> None:
        self.data = data
        self.batch_size = batch_size

    def __iter__(self) -> Any:
        return iter(self.data)

    def __len__(self) -> int:
        return len(self.data)


class Clock(BaseHook):
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.times: list[float] = []
        self.start = 0.0

    def on_before_step(self, trainer: Any) -> None:
        sync(self.device)
        self.start = time.perf_counter()

    def on_after_step(self, trainer: Any) -> None:
        sync(self.device)
        self.times.append(time.perf_counter() - self.start)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def by_hand(args: argparse.Namespace, stage: int, device: torch.device) -> tuple[list[float], int]:
    import deepspeed

    from trainloop.settings.deepspeed import filled_config

    torch.manual_seed(0)
    model = Transformer(args.vocab, args.width, args.layers).to(device)
    filled = filled_config(config(stage), accumulation=1, grad_clip=None, mixed_precision="bf16",
                           batch_size=args.batch)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=filled)
    times = []
    for tokens in batches(args, device):
        sync(device)
        start = time.perf_counter()
        engine.backward(loss_of(engine, tokens))
        engine.step()
        sync(device)
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    engine.destroy()
    return times, peak


def with_trainloop(args: argparse.Namespace, stage: int, device: torch.device) -> tuple[list[float], int]:
    data = batches(args, device)

    class Trainer(BaseTrainer):
        def build_data_loader(self) -> Any:
            return Batches(data, args.batch)

        def build_model(self) -> nn.Module:
            torch.manual_seed(0)
            return Transformer(args.vocab, args.width, args.layers).to(device)

        def build_optimizer(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.model.parameters(), lr=1e-4)

        def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
            return loss_of(self.model, tokens), {}

    clock = Clock(device)
    trainer = Trainer(max_steps=args.steps, device=str(device), mixed_precision="bf16", deepspeed=config(stage),
                      metrics_file=False)
    trainer.build_hooks = lambda: [clock]  # type: ignore[method-assign]
    trainer.train()
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    trainer.loop.engine.destroy()
    return clock.times, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    for name in ("RANK", "LOCAL_RANK"):
        os.environ.setdefault(name, "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    cuda = torch.cuda.is_available()
    device = torch.device("cuda:0" if cuda else "cpu")
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    name = torch.cuda.get_device_name(device) if cuda else "CPU"
    print(f"{name}; width {args.width}, {args.layers} layers, seq {args.seq}, batch {args.batch}, bf16, AdamW; "
          f"median of {args.steps - args.warmup} steps after {args.warmup}")
    for stage in (0, 1, 2, 3):
        for way, run in (("by hand", by_hand), ("trainloop", with_trainloop)):
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            times, peak = run(args, stage, device)
            median = statistics.median(times[args.warmup:]) * 1e3
            memory = f", peak {peak / 2**20:.0f} MiB" if cuda else ""
            print(f"ZeRO-{stage} {way:9s}: {median:7.2f} ms/step{memory}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
