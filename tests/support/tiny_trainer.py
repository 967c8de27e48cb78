"""A tiny, deterministic CPU trainer shared by the tests (also importable by test subprocesses)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainloop import BaseHook, BaseTrainer, Loss


def make_data(n: int = 64, seed: int = 0) -> TensorDataset:
    """A fixed regression problem: y = x @ w + noise."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.01 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


class TinyTrainer(BaseTrainer):
    """A 4-8-1 MLP regressed with SGD on :func:`make_data`, 8 samples per batch.

    Args:
        hooks: Hooks for this run (``build_hooks`` returns them).
        data: What ``build_data_loader`` returns; a DataLoader over ``make_data()`` if omitted.
        lr: SGD learning rate.
        make_optimizer: Builds the optimizer from the parameters and ``lr`` instead of plain SGD
            (e.g. ``lambda params, lr: torch.optim.AdamW(params, lr, fused=True)``).
    """

    def __init__(self, *args: Any, hooks: list[BaseHook] | None = None, data: Any = None, lr: float = 0.05,
                 make_optimizer: Any = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._hooks = hooks or []
        self._data_source = data
        self.lr = lr
        self._make_optimizer = make_optimizer

    def build_data_loader(self):
        if self._data_source is not None:
            return self._data_source
        return DataLoader(make_data(), batch_size=8)

    def build_model(self):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).to(self.device)

    def build_optimizer(self):
        if self._make_optimizer is not None:
            return self._make_optimizer(self.model.parameters(), self.lr)
        return torch.optim.SGD(self.model.parameters(), lr=self.lr)

    def build_hooks(self):
        return self._hooks

    def forward(self, batch):
        x, y = batch
        loss = nn.functional.mse_loss(self.model(x.to(self.device)), y.to(self.device))
        return loss, {"mse": loss.detach()}


class FlakyTrainer(TinyTrainer):
    """Returns a NaN loss for the microsteps listed in ``nan_at`` (counted over the run)."""

    def __init__(self, *args, nan_at=(), **kwargs):
        super().__init__(*args, **kwargs)
        self.nan_at = set(nan_at)
        self.calls = 0

    def forward(self, batch):
        loss, records = super().forward(batch)
        self.calls += 1
        if self.calls in self.nan_at or "all" in self.nan_at:
            loss = loss * float("nan")
        return loss, records


class ItemsTrainer(TinyTrainer):
    """Counts its items: ``Loss(sum, count)`` over the samples whose first feature exceeds ``-0.5``.

    The count is a tensor left on the device (``mask.sum()``); the records also declare a count of
    their own as a Python int, ``{"tokens": {"input": 4 * len(batch)}}``, to be read by key.
    ``rank_items`` adds that many items to every count (ranks that count differently).
    """

    def __init__(self, *args, rank_items: int = 0, **kwargs):
        super().__init__(*args, **kwargs)
        self.rank_items = rank_items

    def forward(self, batch):
        x, y = batch
        mask = items_mask(x)
        per_item = ((self.model(x.to(self.device)) - y.to(self.device)) ** 2).squeeze(1)
        count = mask.sum() + self.rank_items
        return Loss((per_item * mask).sum(), count), {"tokens": {"input": 4 * len(x)}}


def items_mask(x: torch.Tensor) -> torch.Tensor:
    """The items ``ItemsTrainer`` counts in a batch, as a 0/1 float mask."""
    return (x[:, 0] > -0.5).float()
