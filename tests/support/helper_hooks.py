"""The helper hooks the tests share (also importable by test subprocesses): hooks that capture
what a run did, request something at a chosen step, or log made-up records. A test that needs a
hook of its own for one scenario defines it where it is used."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from trainloop import BaseHook, BaseTrainer
from trainloop.step_info import StepInfo


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
        self.found: bool | None = None  # on load: whether the state dict held this hook's entry

    def on_after_step(self, trainer: BaseTrainer) -> None:
        self.count += 1

    def on_state_dict(self, trainer: BaseTrainer, state_dict: dict[str, Any]) -> None:
        state_dict[self.name] = {"count": self.count}

    def on_load_state_dict(self, trainer: BaseTrainer, state_dict: dict[str, Any]) -> None:
        self.found = self.name in state_dict
        if self.found:
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
    """Loads a trainer state dict when the run restores, as a checkpoint hook would: one saved
    by ``SaveAtStep`` (a path) or one held in memory."""

    def __init__(self, source: Path | dict[str, Any]) -> None:
        self.source = source

    def on_enter_restoring(self, trainer: BaseTrainer) -> None:
        state = self.source if isinstance(self.source, dict) else torch.load(self.source, weights_only=True)
        trainer.load_state_dict(state)


class SignalAtStep(BaseHook):
    """Sends this process a real signal as the given step begins."""

    def __init__(self, step: int, signum: int) -> None:
        self.step, self.signum = step, signum

    def on_before_step(self, trainer: BaseTrainer) -> None:
        if trainer.step == self.step:
            os.kill(os.getpid(), self.signum)


class MemoryHook(BaseHook):
    """Records a made-up peak memory (GiB) in each step's info, as ``CudaMaxMemoryHook`` does.

    Args:
        memory: The value for a step (``None``: nothing recorded at that step); 1.5 at every step
            if omitted.
    """

    def __init__(self, memory: Callable[[int], float | None] = lambda step: 1.5) -> None:
        self.memory = memory

    def on_after_step(self, trainer: BaseTrainer) -> None:
        value = self.memory(trainer.step)
        if value is not None:
            trainer.step_info["max_memory"] = value


class LogCapture(BaseHook):
    """Keeps what reaches ``on_log``, with the step."""

    def __init__(self) -> None:
        self.logged: list[tuple[int, dict[str, Any]]] = []

    def on_log(self, trainer: BaseTrainer, records: dict[str, Any]) -> None:
        self.logged.append((trainer.step, records))


class LogHook(BaseHook):
    """Logs the step's loss (a tensor, as ``forward`` returns it) and fixed extra records every
    step, and images at the steps given; keeps the loss it logged per step.

    Args:
        extra: Records logged beside the loss at every step.
        images: Images to log, by step.
    """

    def __init__(self, extra: dict[str, Any] | None = None, images: dict[int, dict[str, Any]] | None = None) -> None:
        self.extra, self.images = extra or {}, images or {}
        self.logged: dict[int, float] = {}

    def on_after_step(self, trainer: BaseTrainer) -> None:
        mse = trainer.step_info.records[0]["mse"]
        self.logged[trainer.step] = float(mse)
        trainer.log({"loss": {"mse": mse}, **self.extra})
        if trainer.step in self.images:
            trainer.log_images(self.images[trainer.step])


class SaveRecorder(BaseHook):
    """Records the step of every entry into ``checkpointing``."""

    def __init__(self) -> None:
        self.saved: list[int] = []

    def on_enter_checkpointing(self, trainer: BaseTrainer) -> None:
        self.saved.append(trainer.step)
