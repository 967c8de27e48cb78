"""A tiny, deterministic CPU trainer shared by the tests (also importable by test subprocesses)."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainloop import BaseHook, BaseTrainer
from trainloop.step import StepInfo


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
    """

    def __init__(self, *args: Any, hooks: list[BaseHook] | None = None, data: Any = None, lr: float = 0.05, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._hooks = hooks or []
        self._data_source = data
        self.lr = lr

    def build_data_loader(self):
        if self._data_source is not None:
            return self._data_source
        return DataLoader(make_data(), batch_size=8)

    def build_model(self):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).to(self.device)

    def build_optimizer(self):
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


class CaptureHook(BaseHook):
    """Records every call it receives, with the trainer's state and step at that moment."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, int]] = []
        self.step_infos: list[StepInfo] = []
        self.logged: list[dict[str, Any]] = []

    def _record(self, trainer: BaseTrainer, event: str) -> None:
        self.calls.append((event, trainer.state.value, trainer.step))

    def on_before_train(self, trainer):
        self._record(trainer, "on_before_train")

    def on_before_step(self, trainer):
        self._record(trainer, "on_before_step")

    def on_before_optimizer_step(self, trainer):
        self._record(trainer, "on_before_optimizer_step")

    def on_after_step(self, trainer):
        self._record(trainer, "on_after_step")
        self.step_infos.append(copy.copy(trainer.step_info))

    def on_exception(self, trainer, error):
        self._record(trainer, "on_exception")
        self.error = error

    def on_after_train(self, trainer):
        self._record(trainer, "on_after_train")

    def on_log(self, trainer, records):
        self.logged.append(records)

    def events(self, name: str) -> list[tuple[str, str, int]]:
        """The recorded calls of one method."""
        return [c for c in self.calls if c[0] == name]


class CounterHook(BaseHook):
    """A hook with state: counts the steps it saw, saved under its name."""

    def __init__(self) -> None:
        self.count = 0

    def on_after_step(self, trainer: BaseTrainer) -> None:
        self.count += 1

    def on_state_dict(self, trainer: BaseTrainer, state_dict: dict[str, Any]) -> None:
        state_dict[self.name] = {"count": self.count}

    def on_load_state_dict(self, trainer: BaseTrainer, state_dict: dict[str, Any]) -> None:
        self.count = state_dict[self.name]["count"]


class ExitAt(BaseHook):
    """Requests a clean exit after the given step."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_after_step(self, trainer: BaseTrainer) -> None:
        if trainer.step == self.step:
            trainer.request_exit()


class SaveAtStep(BaseHook):
    """Keeps a copy of the trainer's state dict at one step, as a checkpoint would."""

    def __init__(self, step: int, path: Path) -> None:
        self.step, self.path = step, path

    def on_after_step(self, trainer: BaseTrainer) -> None:
        if trainer.step == self.step:
            torch.save(trainer.state_dict(), self.path)


class LoadHook(BaseHook):
    """Loads a state dict saved by ``SaveAtStep`` when the run restores."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_enter_restoring(self, trainer: BaseTrainer) -> None:
        trainer.load_state_dict(torch.load(self.path, weights_only=True))


class SignalAtStep(BaseHook):
    """Sends this process a real signal as the given step begins."""

    def __init__(self, step: int, signum: int) -> None:
        self.step, self.signum = step, signum

    def on_before_step(self, trainer: BaseTrainer) -> None:
        if trainer.step == self.step:
            os.kill(os.getpid(), self.signum)
