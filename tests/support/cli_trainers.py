"""Trainers that tests/cli/test_cli.py names on the command line (``cli_trainers:CliTrainer``).

Needs ``tests/support/`` on ``PYTHONPATH``. Everything a run does comes from its settings file, as it
would for a user's trainer run by ``trainloop run``.
"""

from __future__ import annotations

import time

import torch
from pydantic import Field
from tiny_trainer import TinyTrainer
from torch import nn

from trainloop import BaseHook, BaseTrainer, TrainerSettings
from trainloop.settings.types import NonNegativeFloat, PositiveInt, StrictBool


class CliSettings(TrainerSettings):
    """TinyTrainer's settings plus knobs the CLI tests turn from a settings file."""

    lr: float = Field(0.05, gt=0)
    """SGD learning rate."""
    step_sleep: NonNegativeFloat = 0.0
    """Seconds to sleep before each step, so a signal lands mid-run."""
    nan_at_steps: tuple[PositiveInt, ...] = ()
    """Steps whose first attempt gets a NaN loss (and so is retried)."""
    report: StrictBool = False
    """Print ``step <n>`` to stdout after each step (flushed), for a parent process to wait on."""


class _ReportHook(BaseHook):
    def __init__(self, sleep: float, report: bool) -> None:
        self.sleep = sleep
        self.report = report

    def on_before_step(self, trainer):
        if self.sleep:
            time.sleep(self.sleep)

    def on_after_step(self, trainer):
        if self.report:
            print("step", trainer.step, flush=True)


class CliTrainer(TinyTrainer):
    """TinyTrainer driven only by :class:`CliSettings` (its hooks are the declared ones)."""

    settings_class = CliSettings

    def __init__(self, settings: CliSettings | None = None, /, **kwargs):
        super().__init__(settings, **kwargs)
        self.lr = self.settings.lr

    def build_optimizer(self):
        # The declared optimizer when there is one; TinyTrainer's SGD otherwise.
        return BaseTrainer.build_optimizer(self) if self.settings.optimizer else super().build_optimizer()

    def build_hooks(self):
        hooks = BaseTrainer.build_hooks(self)
        if self.settings.step_sleep or self.settings.report:
            hooks.append(_ReportHook(self.settings.step_sleep, self.settings.report))
        return hooks

    def forward(self, batch):
        loss, records = super().forward(batch)
        if self.step in self.settings.nan_at_steps and self.step_info.non_finite_grad_retries == 0:
            loss = loss * float("nan")
        return loss, records


class BuildCrashTrainer(CliTrainer):
    """CliTrainer whose ``build_model`` raises: the run ends while building."""

    def build_model(self):
        raise RuntimeError("no memory left for the model")


class NotATrainer:
    """A class that is not a BaseTrainer, for the CLI's error path."""


class TwoPartTrainer(CliTrainer):
    """CliTrainer's regression with a ``body`` and a ``head``, each stepped by the optimizer ``optimizers`` declares
    for it (``module: body``, ``module: head``): ``forward(batch, optimizer)`` is called once per update."""

    build_optimizer = BaseTrainer.build_optimizer  # the declared optimizers

    def build_model(self):
        torch.manual_seed(0)
        return nn.ModuleDict({"body": nn.Sequential(nn.Linear(4, 8), nn.Tanh()), "head": nn.Linear(8, 1)})

    def forward(self, batch, optimizer):
        x, y = batch
        loss = nn.functional.mse_loss(self.model["head"](self.model["body"](x)), y)
        return loss, {}
