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

from trainloop.distributed.ranks import rank, world_size
from trainloop.settings.types import NonNegativeFloat, PositiveInt

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
