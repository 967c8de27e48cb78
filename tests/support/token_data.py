"""Variable-length token data for the Loss(sum, count) tests."""

from __future__ import annotations

import torch
from tiny_trainer import TinyTrainer

from trainloop import Loss

LENGTHS = [1, 7, 3, 8, 2, 5, 8, 1]  # tokens per sequence, padded to 8


def sequences() -> list[dict[str, torch.Tensor]]:
    """One sequence per batch: tokens (8, 4), targets (8, 1), mask (8,)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for length in LENGTHS:
        mask = torch.zeros(8)
        mask[:length] = 1
        out.append({"x": torch.randn(8, 4, generator=g), "y": torch.randn(8, 1, generator=g), "mask": mask})
    return out


def stack(batches: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.cat([b[k] for b in batches]) for k in batches[0]}


class TokenTrainer(TinyTrainer):
    """Per-token squared error, returned as Loss(sum over real tokens, their count)."""

    def forward(self, batch):
        per_token = (self.model(batch["x"]) - batch["y"]).pow(2).squeeze(1) * batch["mask"]
        return Loss(per_token.sum(), batch["mask"].sum()), {}


def mean_over_tokens_trainer(data, **kwargs) -> TinyTrainer:
    """The reference: a plain mean over every real token of a big batch."""

    class Reference(TinyTrainer):
        def forward(self, batch):
            per_token = (self.model(batch["x"]) - batch["y"]).pow(2).squeeze(1) * batch["mask"]
            return per_token.sum() / batch["mask"].sum(), {}

    return Reference(data=data, **kwargs)


def model_params(trainer: TinyTrainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.unwrapped_model.parameters()]



