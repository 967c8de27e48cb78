"""2-rank gloo workers for tests/checkpoint/test_export.py (spawned, so importable by module name)."""

from __future__ import annotations

import os
from typing import Any

import torch
from dist_workers import set_torchrun_env
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from trainloop import BaseTrainer
from trainloop.distributed import init_distributed, rank, wrap_model
from trainloop.hooks.checkpointing import CheckpointingHook
from trainloop.hooks.export import ExportHook


class TiedLM(nn.Module):
    """GPT-2's weight tying in miniature: the output head is the token embedding."""

    def __init__(self, vocab: int = 11, dim: int = 6) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.block = nn.Linear(dim, dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm_head(torch.tanh(self.block(self.wte(tokens))))


def tokens(n: int = 32) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 11, (n, 5), generator=g)
    return TensorDataset(x, torch.roll(x, -1, dims=1))


class TiedTrainer(BaseTrainer):
    """A tied-embedding model under DDP (when a process group exists), each rank its shard of data."""

    def __init__(self, *args: Any, hooks: list | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._hooks = hooks or []

    def build_data_loader(self):
        data = tokens()
        sampler = DistributedSampler(data, shuffle=False) if torch.distributed.is_initialized() else None
        return DataLoader(data, batch_size=4, sampler=sampler)

    def build_model(self):
        torch.manual_seed(0)
        model = TiedLM()
        return wrap_model(model, "ddp") if torch.distributed.is_initialized() else model

    def build_optimizer(self):
        return torch.optim.AdamW(self.model.parameters(), lr=0.05)

    def build_hooks(self):
        return self._hooks

    def forward(self, batch):
        x, y = batch
        loss = nn.functional.cross_entropy(self.model(x).flatten(0, 1), y.flatten())
        return loss, {"loss": loss.detach()}


def sharded_tied_run(rank_: int, world: int, port: int, out: str) -> None:
    """Train a tied DDP model 3 steps, save a sharded checkpoint, export at the end; rank 0
    keeps the unwrapped model's state dict as the reference."""
    set_torchrun_env(rank_, world, port)
    with init_distributed(backend="gloo", device="cpu"):
        trainer = TiedTrainer(
            max_steps=3, workspace=os.path.join(out, "ws"), seed=0,
            hooks=[CheckpointingHook(interval=3, format="sharded"), ExportHook(path="end.safetensors")],
        )
        trainer.train()
        if rank() == 0:
            state = {k: v.detach().clone() for k, v in trainer.unwrapped_model.state_dict().items()}
            torch.save(state, os.path.join(out, "reference.pt"))


def get_batch_loader():
    """nanoGPT's get_batch as an infinite iterator: random offsets from torch's global generator."""
    data = torch.arange(100)
    while True:
        ix = torch.randint(len(data) - 6, (4,))
        x = torch.stack([data[i : i + 5] for i in ix]) % 11
        yield x, (x + 1) % 11


class GetBatchTrainer(TiedTrainer):
    def build_data_loader(self):
        return get_batch_loader()


def identical_batches(rank_: int, world: int, port: int, out: str) -> None:
    """Three 1-step DDP runs seeded alike: a global-generator loader, the same with
    seed_per_rank, and a DistributedSampler; each rank records the warnings it saw."""
    import warnings

    from trainloop.core.rank_seeds import IdenticalBatchesWarning

    set_torchrun_env(rank_, world, port)
    seen = {}
    with init_distributed(backend="gloo", device="cpu"):
        for name, cls, extra in [
            ("get_batch", GetBatchTrainer, {}),
            ("get_batch_seed_per_rank", GetBatchTrainer, {"seed_per_rank": True}),
            ("distributed_sampler", TiedTrainer, {}),
        ]:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                cls(max_steps=2, seed=0, **extra).train()
            seen[name] = [str(w.message) for w in caught if issubclass(w.category, IdenticalBatchesWarning)]
    torch.save(seen, os.path.join(out, f"rank{rank_}.pt"))
