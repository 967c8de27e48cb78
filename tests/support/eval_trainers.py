"""A trainer whose validation is a real, reducible metric, for evaluate runs and the ``validating`` state.

Named on the command line as ``eval_trainers:EvalTrainer`` (needs ``tests/support/`` on ``PYTHONPATH``).
"""

from __future__ import annotations

import os
import signal
import time

import torch
from cli_trainers import CliSettings, CliTrainer
from tiny_trainer import make_data
from torch.utils.data import DataLoader, DistributedSampler

from trainloop.distributed import ItemMeans
from trainloop.distributed.ranks import rank, world_size
from trainloop.settings.types import NonNegativeFloat, PositiveInt, StrictBool

VAL_SIZE = 25  # odd: it does not divide by two ranks


class EvalSettings(CliSettings):
    """CliTrainer's knobs, and the validation's."""

    val_sleep: NonNegativeFloat = 0.0
    """Seconds each validation sleeps: a long validation."""
    val_marker: str | None = None
    """A file each validation appends ``<step> <time.time()>`` to when it starts (a line per validation)."""
    signal_at_step: PositiveInt | None = None
    """The step in whose forward the process sends itself SIGTERM (a real signal, mid-step)."""


class EvalTrainer(CliTrainer):
    """CliTrainer with ``val_metrics``: the mean squared error over 25 held-out samples, exact under DDP."""

    settings_class = EvalSettings

    def val_metrics(self) -> dict[str, float]:
        """Each rank scores samples rank, rank + world, ...; sums and counts are reduced over ranks."""
        settings = self.settings
        if settings.val_marker:
            with open(settings.val_marker, "a") as marker:
                marker.write(f"{self.step} {time.time()!r}\n")
        time.sleep(settings.val_sleep)
        x, y = make_data(VAL_SIZE, seed=1).tensors
        mine = slice(rank(), None, world_size())
        errors = (self.model(x[mine]) - y[mine]).double().pow(2)
        totals = torch.stack([errors.sum(), torch.tensor(float(errors.numel()), dtype=torch.float64)])
        if world_size() > 1:
            torch.distributed.all_reduce(totals)
        return {"loss": (totals[0] / totals[1]).item(), "count": totals[1].item()}

    def build_hooks(self):
        return [*super().build_hooks(), *self._hooks]  # the declared ones, and those given in Python

    def forward(self, batch):
        if self.step == self.settings.signal_at_step and self.step_info.non_finite_grad_retries == 0:
            os.kill(os.getpid(), signal.SIGTERM)  # recorded by the handler; the step goes on
        return super().forward(batch)


class ItemMeansSettings(EvalSettings):
    """EvalSettings plus the validation loader's shape."""

    val_items: PositiveInt = 7
    """Items of the validation set, ``make_data(val_items, seed=1)``: 7 does not divide by 2 ranks, 10 not by 3."""
    val_batch_size: PositiveInt = 2
    """The validation loader's batch size."""
    val_shuffle: StrictBool = False
    """Whether the validation sampler shuffles (a DistributedSampler under several ranks)."""


class ItemMeansTrainer(EvalTrainer):
    """EvalTrainer whose ``val_metrics`` iterates a validation loader and reduces with ``ItemMeans``.

    Under several ranks the loader has a ``DistributedSampler``, which pads the set to a multiple of
    the ranks; ``naive/loss`` is the all-reduce of sums and counts over what each rank drew, padding
    included, for the tests to show what ``ItemMeans`` leaves out.
    """

    settings_class = ItemMeansSettings
    settings: ItemMeansSettings

    def val_metrics(self) -> dict[str, object]:
        data = make_data(self.settings.val_items, seed=1)
        shuffle = self.settings.val_shuffle
        sampler = DistributedSampler(data, shuffle=shuffle, seed=3) if world_size() > 1 else None
        loader = DataLoader(data, batch_size=self.settings.val_batch_size, sampler=sampler, shuffle=shuffle and not sampler)
        means = ItemMeans(loader)
        naive = torch.zeros(2, dtype=torch.float64)
        for x, y in loader:
            errors = (self.model(x) - y).pow(2)
            means.add(loss=errors, target=y)  # the targets: data, not the model's rounding
            naive += torch.stack([errors.double().sum(), torch.tensor(float(errors.numel()), dtype=torch.float64)])
        if world_size() > 1:
            torch.distributed.all_reduce(naive)
        return {**means.reduce(), "naive": {"loss": (naive[0] / naive[1]).item()}}


class TorchrunItemMeansTrainer(ItemMeansTrainer):
    """ItemMeansTrainer that joins torchrun's process group when constructed: DDP, each rank its training shard.

    ``trainloop run|evaluate ... --trainer eval_trainers:TorchrunItemMeansTrainer`` under ``torchrun``.
    """

    def __init__(self, settings: ItemMeansSettings | None = None, /, **kwargs):
        from trainloop.distributed import init_distributed

        init_distributed(backend="gloo", device="cpu")  # the group lives as long as the process (torchrun's workers exit after the command)
        super().__init__(settings, **kwargs)

    def build_data_loader(self):
        data = make_data()
        return DataLoader(data, batch_size=8, sampler=DistributedSampler(data, seed=0))

    def build_model(self):
        from trainloop.distributed import wrap_model  # its FSDP import only where it is used

        return wrap_model(super().build_model(), "auto")
