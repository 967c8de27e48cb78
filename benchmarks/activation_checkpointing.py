"""Activation checkpointing through ``wrap_model``: bytes saved for backward, peak memory and step time.

A small GPT-style transformer (pre-norm blocks of ``nn.TransformerEncoderLayer``, causal), once
as it is and once with ``wrap_model(model, "none", activation_checkpointing=Block)``:

- bytes saved for backward: every tensor autograd keeps from one forward, counted with
  ``torch.autograd.graph.saved_tensors_hooks`` (device-independent, exact);
- on CUDA, the peak memory allocated during one training step (``torch.cuda.max_memory_allocated``
  after a reset, weights and AdamW state included);
- time per training step (forward, backward, AdamW step): rounds interleaved, medians; on CUDA
  between synchronised points.

Run: ``python benchmarks/activation_checkpointing.py [--device cuda] [--layers 6] [--width 256]
[--block 128] [--batch 8] [--rounds 5] [--steps 5]``
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from trainloop.distributed import wrap_model


class Block(nn.Module):
    """One pre-norm transformer layer with a causal mask."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device)
        return self.layer(x, src_mask=mask, is_causal=True)


class GPT(nn.Module):
    def __init__(self, vocab: int, width: int, heads: int, layers: int, block: int) -> None:
        super().__init__()
        self.token = nn.Embedding(vocab, width)
        self.position = nn.Embedding(block, width)
        self.blocks = nn.Sequential(*(Block(width, heads) for _ in range(layers)))
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.token(tokens) + self.position(torch.arange(tokens.shape[1], device=tokens.device))
        return self.head(self.blocks(x))


def build(args: argparse.Namespace, checkpointed: bool) -> nn.Module:
    torch.manual_seed(0)
    model = GPT(args.vocab, args.width, args.heads, args.layers, args.block).to(args.device)
    return wrap_model(model, "none", activation_checkpointing=Block if checkpointed else None)


def loss_of(model: nn.Module, tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))


def saved_bytes(model: nn.Module, tokens: torch.Tensor, vocab: int) -> int:
    total = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = loss_of(model, tokens, vocab)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return total


def step_seconds(
    model: nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor, args: argparse.Namespace
) -> float:
    cuda = tokens.is_cuda
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.steps):
        loss_of(model, tokens, args.vocab).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / args.steps


def peak_bytes(model: nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor, vocab: int) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    loss_of(model, tokens, vocab).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(args.vocab, (args.batch, args.block + 1), generator=g).to(args.device)
    runs = {}
    for checkpointed in (False, True):
        model = build(args, checkpointed)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        runs[checkpointed] = (model, optimizer)
        step_seconds(model, optimizer, tokens, argparse.Namespace(**{**vars(args), "steps": 1}))  # warm up
    seconds: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.rounds):  # interleaved
        for checkpointed, (model, optimizer) in runs.items():
            seconds[checkpointed].append(step_seconds(model, optimizer, tokens, args))
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    print(f"{name}, torch {torch.__version__}: {args.layers} blocks, width {args.width}, "
          f"{args.batch}x{args.block} tokens; median of {args.rounds} rounds of {args.steps} steps")
    base = statistics.median(seconds[False])
    for checkpointed, (model, optimizer) in runs.items():
        label = "checkpointed" if checkpointed else "plain"
        saved = saved_bytes(model, tokens, args.vocab)
        ms, ratio = statistics.median(seconds[checkpointed]) * 1e3, statistics.median(seconds[checkpointed]) / base
        line = f"  {label:<12} saved for backward {saved / 2**20:8.1f} MiB  {ms:8.2f} ms/step ({ratio:.2f}x)"
        if tokens.is_cuda:
            line += f"   peak {peak_bytes(model, optimizer, tokens, args.vocab) / 2**20:8.1f} MiB"
        print(line)


if __name__ == "__main__":
    main()
