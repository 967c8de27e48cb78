"""Trainers that predict, for tests/predict/ and the predict runs under torchrun (``predict_trainers:PredictTrainer``).

Needs ``tests/support/`` on ``PYTHONPATH``. What a run predicts comes from its settings, as it would
for a user's trainer run by ``trainloop predict``.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from tiny_trainer import TinyTrainer, make_data
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from trainloop import TrainerSettings
from trainloop.distributed import init_distributed, world_size, wrap_model


class PredictSettings(TrainerSettings):
    """TinyTrainer's settings plus what the predict tests turn."""

    items: int = Field(13, ge=0)
    """Items of the predict data: ``make_data(items, seed=1)``."""
    batch_size: int = Field(4, gt=0)
    """The predict loader's batch size."""
    shuffle: bool = False
    """Whether the predict data's sampler shuffles (a DistributedSampler under several ranks)."""
    returns: Literal["tensor", "dict", "list", "none", "wider", "flat", "double"] = "dict"
    """What ``predict_step`` returns: the model's outputs, a dict with the inputs too, a wrong type, or the outputs
    twice as wide, flattened to 1-D or in float64."""
    wrong_at_batch: int = 0
    """The first batch for which ``predict_step`` returns ``returns`` when it is a wrong one (before: a dict, or the
    model's outputs for the last three)."""


class PredictTrainer(TinyTrainer):
    """TinyTrainer that predicts ``y`` for ``make_data(settings.items, seed=1)``."""

    settings_class = PredictSettings
    settings: PredictSettings

    def __init__(self, settings: PredictSettings | None = None, /, **kwargs):
        super().__init__(settings, **kwargs)
        self.batches = 0

    def build_predict_data_loader(self):
        data = make_data(self.settings.items, seed=1)
        if world_size() > 1:
            sampler = DistributedSampler(data, shuffle=self.settings.shuffle, seed=7)
            return DataLoader(data, batch_size=self.settings.batch_size, sampler=sampler)
        return DataLoader(data, batch_size=self.settings.batch_size, shuffle=self.settings.shuffle)

    def predict_step(self, batch):
        x, _ = batch
        y = self.model(x.to(self.device))
        returns, batch_index = self.settings.returns, self.batches
        self.batches += 1
        if returns == "tensor":
            return y
        if returns in ("wider", "flat", "double"):
            if batch_index < self.settings.wrong_at_batch:
                return y
            return {"wider": torch.cat([y, y], 1), "flat": y.flatten(), "double": y.double()}[returns]
        if returns == "dict" or batch_index < self.settings.wrong_at_batch:
            return {"y": y, "x": x}
        return [y] if returns == "list" else None


class TorchrunPredictTrainer(PredictTrainer):
    """PredictTrainer that joins torchrun's process group when constructed, its model wrapped in DDP.

    ``trainloop predict ... --trainer predict_trainers:TorchrunPredictTrainer`` under ``torchrun``.
    """

    def __init__(self, settings: PredictSettings | None = None, /, **kwargs):
        init_distributed(backend="gloo", device="cpu")  # the group lives as long as the process (torchrun's workers exit after the command)
        super().__init__(settings, **kwargs)

    def build_model(self):
        return wrap_model(super().build_model())


class NamedModule(nn.Module):
    """TinyTrainer's MLP inside a submodule named ``module``: the name DDP gives the model it wraps."""

    def __init__(self) -> None:
        super().__init__()
        self.module = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x):
        return self.module(x)


class ModuleNamedTrainer(PredictTrainer):
    """PredictTrainer whose model has its own submodule named ``module`` (its keys: ``module.0.weight``...)."""

    def build_model(self):
        torch.manual_seed(0)
        return NamedModule().to(self.device)

    def val_metrics(self) -> dict[str, float]:
        x, y = make_data(16, seed=2).tensors
        return {"loss": float(nn.functional.mse_loss(self.model(x.to(self.device)), y.to(self.device)))}
