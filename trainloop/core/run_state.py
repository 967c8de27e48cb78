"""The run as the loop owns it (``RunState``), and the run as hooks see it (``TrainerView``).

The loop (``trainloop.core.loop.Loop``) is the only writer of a run's state: the step and epoch, the
built components, the hooks and their dispatch, the data iterator; its ``Step``
(``trainloop.core.step``) writes the step's part (the step info, the optimizer updating, the device
verdicts). The trainer
shows them read-only; a hook reads them and *requests* (``request_exit``, ``request_checkpoint``,
``log``). ``TrainerView`` is that read-only face as a typing protocol: the built-in hooks, the
``every`` rule, the preflight, ``training_state`` and ``result`` are typed against it, so none of
them imports ``trainloop.trainer`` (which imports them): the house has no import cycle.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from trainloop.machine.table import State
from trainloop.step_info import StepInfo

if TYPE_CHECKING:
    from logging import Logger
    from pathlib import Path

    import torch
    from torch import nn
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    from torch.distributed.checkpoint.stateful import Stateful

    from trainloop.core.data import EpochIterator
    from trainloop.core.metrics import MetricsLog
    from trainloop.core.run_length import RunLength
    from trainloop.hook_machinery.base import BaseHook
    from trainloop.machine.runner import Handle
    from trainloop.machine.table import Transition
    from trainloop.settings.model import TrainerSettings
    from trainloop.utils import Records

__all__ = ["COMPONENTS", "SINGLE", "Dispatch", "RunState", "TrainerContract", "TrainerView", "not_built"]

Dispatch = dict[str, tuple[Callable[..., None], ...]]
"""Per hook event, the bound methods of the hooks that override it (``hook_dispatch``)."""

#: The name of a run's one optimizer (``build_optimizer()`` returned an optimizer, not a mapping).
SINGLE = "default"

#: What ``building`` builds, in order, each by the trainer's ``build_<name>()``.
COMPONENTS = ("data_loader", "model", "optimizer", "lr_scheduler", "grad_scaler")

@dataclass(eq=False)
class RunState:
    """One run's state, written by its loop and the loop's ``Step`` only; the trainer shows it read-only.

    Attributes:
        dispatch: The hooks' bound methods per event (only those that override it).
        step: The last begun step: ``begin_step`` increments it, a checkpoint load sets it.
        epoch: The epoch the run resumed in (a checkpoint load sets it); once the run has
            exited, the epoch its data iterator ended in.
        step_info: What the step in progress did (a new one per step).
        hooks: The run's hooks: ``build_hooks()``'s, then those ``settings.hooks`` declares.
        built: The built components by name (see ``COMPONENTS``); a name is absent until built.
        data: The iterator the run draws batches from (``None`` before ``restoring``).
        restored_rng: Random states a checkpoint load restored before ``data`` existed; applied
            once it does (creating it draws from torch's generator).
        restored_position: A plain ``DataLoader``'s position a checkpoint load restored, for
            ``data`` to resume its epoch exactly there (see ``trainloop.core.data``).
        verdicts: The device verdicts of the optimizers that skip a non-finite update on the
            device, by optimizer name (each a ``trainloop.core.step.DeviceVerdict``); made in ``restoring``.
        restored_verdicts: Their states a checkpoint load restored before they existed; applied
            once they do.
        error: What ended the run, if an error did.
        updating: The name of the optimizer whose update is in progress (``SINGLE`` with one).
    """

    dispatch: Dispatch
    step: int = 0
    epoch: int = 0
    step_info: StepInfo = field(default_factory=StepInfo)
    hooks: tuple[BaseHook, ...] = ()
    built: dict[str, Any] = field(default_factory=dict)
    data: EpochIterator | None = None
    restored_rng: dict[str, Any] | None = None
    restored_position: dict[str, Any] | None = None
    verdicts: dict[str, Stateful] = field(default_factory=dict)
    restored_verdicts: dict[str, Any] | None = None
    error: BaseException | None = None
    updating: str = SINGLE

    def component(self, name: str) -> Any:
        """The built component ``name`` (one of ``COMPONENTS``; the optimizer as ``build_optimizer()`` returned it).

        Raises:
            AttributeError: It is not built yet (``not_built``).
        """
        try:
            return self.built[name]
        except KeyError:
            raise not_built(name) from None

    @property
    def named_optimizers(self) -> bool:
        """Whether ``build_optimizer()`` returned optimizers by name (a mapping), not one optimizer."""
        return isinstance(self.built.get("optimizer"), Mapping)

    @property
    def optimizers(self) -> dict[str, Any]:
        """The built optimizers by name, in update order; one optimizer is named ``SINGLE``."""
        built = self.built.get("optimizer")
        if built is None:
            raise AttributeError(
                "trainer.optimizers is not built yet: train() builds it with build_optimizer() in 'building'"
            )
        return dict(built) if isinstance(built, Mapping) else {SINGLE: built}

    @property
    def lr_schedulers(self) -> dict[str, Any]:
        """The built lr schedulers by their optimizer's name (none: empty)."""
        built = self.built.get("lr_scheduler")
        if built is None:
            return {}
        if not isinstance(built, Mapping):
            return {SINGLE: built}
        return {name: scheduler for name, scheduler in built.items() if scheduler is not None}

    @property
    def current_epoch(self) -> int:
        """The epoch the run draws from now (0-based): the data iterator's while it exists, else ``epoch``."""
        return self.data.epoch if self.data is not None else self.epoch


def not_built(name: str) -> AttributeError:
    """The error of reading the component ``name`` before ``building`` built it."""
    return AttributeError(f"trainer.{name} is not built yet: train() builds it with build_{name}() in 'building'")


class TrainerView(Protocol):
    """What a hook may read and call on the trainer it is given: a read-only view of the run.

    ``BaseTrainer`` is one. Annotate a hook's ``trainer`` parameter with it (or with your own
    trainer class); its levers are requests the loop settles at the end of a step.

    Attributes:
        state_dict_options: Options for ``torch.distributed.checkpoint.state_dict`` (a runtime
            knob, not run state: a checkpointing hook switches it for a sharded save).
    """

    state_dict_options: StateDictOptions | None

    @property
    def settings(self) -> TrainerSettings:
        """The validated, frozen settings."""

    @property
    def logger(self) -> Logger:
        """Where the trainer and its hooks log."""

    @property
    def device(self) -> torch.device:
        """``settings.device``, or torch's default device."""

    @property
    def workspace(self) -> Path | None:
        """``settings.workspace``."""

    @property
    def state(self) -> State:
        """The machine's current state."""

    @property
    def step(self) -> int:
        """The last begun step."""

    @property
    def epoch(self) -> int:
        """The epoch the run resumed in; after the run, the epoch it ended in."""

    @property
    def step_info(self) -> StepInfo:
        """What the step in progress did; a hook may add records to it."""

    @property
    def max_steps(self) -> int:
        """The run's planned steps."""

    @property
    def run_length(self) -> RunLength:
        """Where the run ends, and the epochs completed so far."""

    @property
    def metrics(self) -> MetricsLog:
        """Every ``log`` call of the run."""

    @property
    def hooks(self) -> Sequence[BaseHook]:
        """The run's hooks, in the order they are called."""

    @property
    def error(self) -> BaseException | None:
        """What ended the run, if an error did."""

    @property
    def exit_requested(self) -> bool:
        """Whether the run ends after this step."""

    @property
    def exit_code(self) -> int | None:
        """The exit code agreed on with an exit request, or ``None``."""

    @property
    def data_loader(self) -> Iterable[Any]:
        """The built data loader."""

    @property
    def model(self) -> nn.Module:
        """The built model (as wrapped)."""

    @property
    def unwrapped_model(self) -> nn.Module:
        """The model without its wrappers."""

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The built optimizer."""

    @property
    def lr_scheduler(self) -> torch.optim.lr_scheduler.LRScheduler | None:
        """The built lr scheduler, or ``None`` (with several optimizers: an error naming ``lr_schedulers``)."""

    @property
    def optimizers(self) -> dict[str, torch.optim.Optimizer]:
        """The built optimizers by name, in update order."""

    @property
    def updating(self) -> str:
        """The name of the optimizer whose update is in progress."""

    @property
    def lr_schedulers(self) -> dict[str, torch.optim.lr_scheduler.LRScheduler]:
        """The built lr schedulers by their optimizer's name."""

    @property
    def grad_scaler(self) -> torch.amp.GradScaler:
        """The built grad scaler."""

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The mixed-precision context ``forward`` runs under."""

    def log(self, records: Records) -> None:
        """Send records to every hook's ``on_log`` (and ``metrics``)."""

    def log_images(self, records: dict[str, Any]) -> None:
        """Send images to every hook's ``on_log_images``."""

    def request_checkpoint(self) -> None:
        """Ask for a save at the end of the current step."""

    def request_exit(self, exit_code: int | None = None) -> None:
        """Ask the run to end cleanly at the end of the current step."""

    def on_edge(self, fn: Callable[[Any, Transition], Any]) -> Handle:
        """Call ``fn(trainer, transition)`` as every edge fires, before anything it does; ``remove()`` the handle."""

    def state_dict(self) -> dict[str, Any]:
        """The full training state."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned (step and epoch included)."""


class TrainerContract(TrainerView, Protocol):
    """The view plus the user's contract: what the loop calls to build and run a step."""

    def build_data_loader(self) -> Iterable[Any]:
        """Return the training data."""

    def build_model(self) -> nn.Module:
        """Return the model."""

    def build_optimizer(self) -> torch.optim.Optimizer | Mapping[str, torch.optim.Optimizer]:
        """Return the optimizer, or several by name."""

    def build_lr_scheduler(
        self,
    ) -> torch.optim.lr_scheduler.LRScheduler | Mapping[str, torch.optim.lr_scheduler.LRScheduler] | None:
        """Return the lr scheduler (by optimizer name with several), or ``None``."""

    def build_grad_scaler(self) -> torch.amp.GradScaler:
        """Return the grad scaler."""

    def build_hooks(self) -> list[BaseHook]:
        """Return the hooks built in code."""

    def forward(self, input: Any) -> tuple[torch.Tensor | None, Records]:
        """Compute the loss of one microstep's batch."""

    def build_predict_data_loader(self) -> Iterable[Any]:
        """Return the data a predict run predicts."""

    def predict_step(self, batch: Any) -> torch.Tensor | dict[str, torch.Tensor]:
        """Return one batch's outputs, one row per item."""

    @classmethod
    def missing_methods(cls, kind: str = "train") -> list[str]:
        """The contract methods the class leaves unimplemented."""
