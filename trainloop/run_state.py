"""The run as the loop owns it (``RunState``), and the run as hooks see it (``TrainerView``).

The loop (``trainloop.loop.Loop``) is the only writer of a run's state: the step and epoch, the
step info, the built components, the hooks and their dispatch, the data iterator. The trainer
shows them read-only; a hook reads them and *requests* (``request_exit``, ``request_checkpoint``,
``log``). ``TrainerView`` is that read-only face as a typing protocol: the built-in hooks, the
``every`` rule, the preflight, ``training_state`` and ``result`` are typed against it, so none of
them imports ``trainloop.trainer`` (which imports them): the house has no import cycle.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, NoReturn, Protocol, TypeVar, overload

from trainloop.machine.table import State
from trainloop.step_info import StepInfo

if TYPE_CHECKING:
    from logging import Logger
    from pathlib import Path

    import torch
    from torch import nn
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    from trainloop.data import EpochIterator
    from trainloop.hooks.base import BaseHook
    from trainloop.machine.runner import Handle
    from trainloop.machine.table import Transition
    from trainloop.metrics import MetricsLog
    from trainloop.nested import Records
    from trainloop.run_length import RunLength
    from trainloop.settings.model import TrainerSettings

__all__ = [
    "COMPONENTS", "Built", "Dispatch", "RunAttributes", "RunState", "RunValue", "TrainerContract", "TrainerView"
]

Dispatch = dict[str, tuple[Callable[..., None], ...]]
"""Per hook event, the bound methods of the hooks that override it (``hook_dispatch``)."""

#: What ``building`` builds, in order, each by the trainer's ``build_<name>()``.
COMPONENTS = ("data_loader", "model", "optimizer", "lr_scheduler", "grad_scaler")

#: Where a component assigned before the trainer's loop exists waits for it (instance ``__dict__``).
EARLY_COMPONENTS = "_components_before_init"


@dataclass(eq=False)
class RunState:
    """One run's state, written by its loop only; the trainer shows it read-only.

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
            ``data`` to resume its epoch exactly there (see ``trainloop.data_position``).
        error: What ended the run, if an error did.
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
    error: BaseException | None = None

    @property
    def current_epoch(self) -> int:
        """The epoch the run draws from now (0-based): the data iterator's while it exists, else ``epoch``."""
        return self.data.epoch if self.data is not None else self.epoch


T = TypeVar("T")


class RunValue(Generic[T]):
    """A trainer attribute that shows its loop's ``RunState``.

    Read-only, and assigning it raises an ``AttributeError`` that says what to do instead (the loop is its one writer).

    Args:
        doc: The attribute's docstring.
        instead: What to call instead of assigning it.
    """

    def __init__(self, doc: str, instead: str, source: str | None = None) -> None:
        self.__doc__ = doc
        self.instead = instead
        self.source = source

    def __set_name__(self, owner: type, name: str) -> None:
        """Learn the attribute's name (and read the run state's attribute of that name, unless ``source``)."""
        self.name = name
        self.source = self.source or name

    @overload
    def __get__(self, trainer: None, owner: type) -> RunValue[T]: ...
    @overload
    def __get__(self, trainer: Any, owner: type) -> T: ...
    def __get__(self, trainer: Any, owner: type) -> RunValue[T] | T:
        """The loop's value (the descriptor itself on the class)."""
        if trainer is None:
            return self
        value: T = getattr(trainer.loop.run_state, self.source)  # type: ignore[arg-type]
        return value

    def __set__(self, trainer: Any, value: NoReturn) -> NoReturn:
        """Refuse, saying what to call instead."""
        raise AttributeError(f"trainer.{self.name} is the loop's and read-only: {self.instead}")


class Built(Generic[T]):
    """A component the loop builds in ``building`` (``build_<name>()``), held in its ``RunState``.

    Before ``train()`` it may be assigned (to use a trainer's ``forward`` outside a run, say);
    during a run, assigning it raises an ``AttributeError``: change the object in place, or
    restore a state with ``load_state_dict()``.
    """

    def __set_name__(self, owner: type, name: str) -> None:
        """Learn the attribute's name."""
        self.name = name
        self.__doc__ = f"The ``build_{name}()`` result, built by the loop in ``building``."

    @overload
    def __get__(self, trainer: None, owner: type) -> Built[T]: ...
    @overload
    def __get__(self, trainer: Any, owner: type) -> T: ...
    def __get__(self, trainer: Any, owner: type) -> Built[T] | T:
        """The built component (the descriptor itself on the class)."""
        if trainer is None:
            return self
        loop = getattr(trainer, "loop", None)  # None: before BaseTrainer.__init__ made it
        try:
            value: T = loop.run_state.built[self.name]  # type: ignore[union-attr]
        except (KeyError, AttributeError):
            raise AttributeError(
                f"trainer.{self.name} is not built yet: train() builds it with build_{self.name}() in 'building'"
            ) from None
        return value

    def __set__(self, trainer: Any, value: T) -> None:
        """Hold ``value`` as the component, unless a run is past ``building``."""
        loop = getattr(trainer, "loop", None)
        if loop is None:  # a subclass's __init__ before it called BaseTrainer's: kept till then
            trainer.__dict__.setdefault(EARLY_COMPONENTS, {})[self.name] = value
            return
        state = trainer.state
        if state not in (State.IDLE, State.BUILDING):
            raise AttributeError(
                f"trainer.{self.name} was built in 'building' and is not replaced during a run (state "
                f"{state.value!r}): change it in place, or restore a state with trainer.load_state_dict()"
            )
        loop.run_state.built[self.name] = value


class RunAttributes:
    """The run's values as a trainer's read-only attributes (``BaseTrainer``'s), read from its loop's ``RunState``."""

    step: RunValue[int] = RunValue(
        "The last begun step: incremented when a new step begins (0 before the first).",
        "to resume at another step, restore a state with trainer.load_state_dict(); "
        "to end the run, call trainer.request_exit()",
    )
    epoch: RunValue[int] = RunValue(
        "The epoch the run draws its batches from (0-based): the one it resumed in before the data "
        "iterator exists, the one its data ended in once the run has exited "
        "(``run_length.epochs_completed`` counts full passes).",
        "restore a state with trainer.load_state_dict(), or end the run with trainer.request_exit()",
        source="current_epoch",
    )
    step_info: RunValue[StepInfo] = RunValue(
        "What the step in progress did (see ``StepInfo``); a hook may add records to it.",
        "the loop starts a new one each step; add records to it instead "
        "(trainer.step_info['name'] = value)",
    )
    hooks: RunValue[tuple[BaseHook, ...]] = RunValue(
        "The run's hooks, in the order they are called: ``build_hooks()``'s, then the declared ones.",
        "return hooks from build_hooks() or declare them in settings.hooks",
    )
    error: RunValue[BaseException | None] = RunValue(
        "What ended the run, if an error did (``train()`` re-raised it).",
        "raise the error, or end the run cleanly with trainer.request_exit()",
    )

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
        """The built lr scheduler, or ``None``."""

    @property
    def grad_scaler(self) -> torch.amp.GradScaler:
        """The built grad scaler."""

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The mixed-precision context ``forward`` runs under."""

    def log(self, records: Records) -> None:
        """Send records to every hook's ``on_log`` (and ``metrics``)."""

    def log_images(self, records: dict[str, Any]) -> None:
        """Send images to every hook's ``on_log_images``."""

    def request_checkpoint(self, at_exit: bool = False) -> None:
        """Ask for a checkpoint at the end of the current step (or whenever the run ends)."""

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

    def build_optimizer(self) -> torch.optim.Optimizer:
        """Return the optimizer."""

    def build_lr_scheduler(self) -> torch.optim.lr_scheduler.LRScheduler | None:
        """Return the lr scheduler, or ``None``."""

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
