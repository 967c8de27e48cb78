"""``BaseTrainer``: the user's contract (``trainloop.trainer``) and the machine seen from outside.

The work of each state is ``trainloop.core.loop``'s; the run's values it shows read-only are declared
by ``trainloop.core.run_state.RunAttributes``, the built components by ``Contract``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from logging import Logger
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Generic, NoReturn, TypeVar, overload

import torch
from torch import nn

from trainloop.core import preflight
from trainloop.core.loop import Loop
from trainloop.core.metrics import MetricsLog
from trainloop.core.result import RefusedRunError, RunKind, RunResult, finish_run
from trainloop.core.run_kinds import WeightsSource
from trainloop.core.run_length import RunLength
from trainloop.core.run_state import SINGLE, RunState, not_built
from trainloop.core.step import NO_CONTEXT, LossNoneWarning, check_forward
from trainloop.core.training_state import ChangedSettingsWarning, load_training_state, training_state
from trainloop.core.workspace import hold_run_workspace
from trainloop.machine.runner import Handle
from trainloop.machine.table import State, Transition
from trainloop.machine.trace import Trace
from trainloop.predict.files import predictions_path
from trainloop.predict.run import PredictRun
from trainloop.settings import optimizer as components
from trainloop.settings.model import TrainerSettings, resolve_settings
from trainloop.step_info import StepInfo
from trainloop.utils import Records, unwrap_model, user_traceback

if TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    from trainloop.hook_machinery.base import BaseHook

__all__ = ["BaseTrainer", "ChangedSettingsWarning", "LossNoneWarning"]


#: Where a component assigned before the trainer's loop exists waits for it (instance ``__dict__``).
EARLY_COMPONENTS = "_components_before_init"

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
        value: T = getattr(trainer._run, self.source)  # type: ignore[arg-type]
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
            raise not_built(self.name) from None
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


class BuiltOneOrMore(Built[T]):
    """A component a trainer builds one of, or several of by name (a mapping): the optimizer, the lr scheduler.

    With several, reading the singular attribute raises an ``AttributeError`` naming the plural.
    """

    def __get__(self, trainer: Any, owner: type) -> Any:
        """The built component; with several, an error naming ``trainer.<name>s``."""
        value = super().__get__(trainer, owner)
        if trainer is not None and isinstance(value, Mapping):
            raise AttributeError(
                f"trainer.{self.name}: this trainer builds several ({', '.join(map(str, value))}); "
                f"read trainer.{self.name}s[name]"
            )
        return value


_PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16}


class BaseTrainer:
    """A training loop whose sequencing is an explicit state machine.

    Subclass it and implement ``build_data_loader``, ``build_model``,
    ``build_optimizer`` and ``forward``; optionally ``build_lr_scheduler``,
    ``build_grad_scaler`` and ``build_hooks``. Construct it from keyword arguments,
    a settings object, or both (keywords override)::

        MyTrainer(max_steps=1000, mixed_precision="bf16", workspace="runs/a").train()
        MyTrainer(TrainerSettings.from_file("run.json")).train()

    Either way ``trainer.settings`` is the validated, frozen settings object (of
    ``settings_class``, which a subclass may point at its own ``TrainerSettings`` subclass).

    Args:
        settings: A settings object; keyword arguments are validated into one when omitted.
        state_dict_options: Options for ``torch.distributed.checkpoint.state_dict`` (runtime
            only, not part of the settings).
        logger: Where the trainer and its hooks log; ``logging.getLogger("trainloop")`` if omitted.
        **kwargs: Fields of ``settings_class`` (see ``TrainerSettings``).

    Raises:
        pydantic.ValidationError: A setting is invalid; the error names the field.
    """

    settings_class: ClassVar[type[TrainerSettings]] = TrainerSettings

    # What ``building`` builds, in this order, each by its ``build_*`` method; the loop holds them.
    data_loader: Built[Iterable[Any]] = Built()
    model: Built[nn.Module] = Built()
    optimizer: BuiltOneOrMore[torch.optim.Optimizer] = BuiltOneOrMore()
    lr_scheduler: BuiltOneOrMore[torch.optim.lr_scheduler.LRScheduler | None] = BuiltOneOrMore()
    grad_scaler: Built[torch.amp.GradScaler] = Built()

    # The run's values, read-only: the loop's ``RunState`` is their one writer.

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

    # -- the user's contract: what a subclass writes, and the optional methods' defaults ------
    def build_data_loader(self) -> Iterable[Any]:
        """Return the training data: an infinite iterator or a re-iterable such as a DataLoader."""
        raise NotImplementedError(f"{type(self).__name__} must implement build_data_loader()")

    def build_model(self) -> nn.Module:
        """Return the model, on its device and already wrapped (DDP, FSDP) if wanted."""
        raise NotImplementedError(f"{type(self).__name__} must implement build_model()")

    def build_optimizer(self) -> torch.optim.Optimizer | Mapping[str, torch.optim.Optimizer]:
        """Return the optimizer of ``self.model``'s parameters, or several by name (each step updates them in order).

        By default, the one ``settings.optimizer`` declares, or those ``settings.optimizers`` declares.
        """
        settings = self.settings
        if settings.optimizers is not None:
            declared = {f"optimizers.{name}": spec for name, spec in settings.optimizers.items()}
        elif settings.optimizer is not None:
            declared = {"optimizer": settings.optimizer}
        else:
            raise NotImplementedError(
                f"{type(self).__name__} must implement build_optimizer() or declare settings.optimizer"
            )
        # A submodule the model lacks is a mistake in the settings: said as they name it, before step 1.
        problems = [f"{field}.module: {problem}" for field, spec in declared.items()
                    if (problem := components.module_problem(spec, self.model)) is not None]
        if problems:
            raise RefusedRunError("\n".join(problems))
        built = {field: components.build_optimizer(spec, self.model) for field, spec in declared.items()}
        if settings.optimizers is not None:
            return {name: built[f"optimizers.{name}"] for name in settings.optimizers}
        return built["optimizer"]

    def build_lr_scheduler(
        self,
    ) -> torch.optim.lr_scheduler.LRScheduler | Mapping[str, torch.optim.lr_scheduler.LRScheduler] | None:
        """Return a learning-rate scheduler stepped after every update of its optimizer, or ``None``.

        With several optimizers, a mapping by optimizer name (an optimizer it leaves out has none). By default,
        ``settings.lr_schedule``'s, one per optimizer.
        """
        schedule = self.settings.lr_schedule
        if schedule is None:
            return None
        schedulers = {
            name: components.build_lr_scheduler(schedule, optimizer, self.max_steps)
            for name, optimizer in self.optimizers.items()
        }
        return schedulers if self._run.named_optimizers else schedulers[SINGLE]

    def build_grad_scaler(self) -> torch.amp.GradScaler:
        """Return the gradient scaler; by default enabled for fp16 mixed precision, unless deepspeed's engine scales."""
        settings = self.settings
        enabled = settings.mixed_precision == "fp16" and settings.deepspeed is None
        return torch.amp.GradScaler(self.device.type, enabled=enabled)

    def build_hooks(self) -> list[BaseHook]:
        """Return the hooks built in code; the run calls them, then those ``settings.hooks`` declares.

        By default none. An override need not (and should not) build the declared hooks.
        """
        return []

    def forward(self, input: Any) -> tuple[torch.Tensor | None, Records]:  # or forward(self, input, optimizer)
        """Compute the loss of one microstep's batch.

        Args:
            input: A batch drawn from the data loader.

        Returns:
            The scalar loss (``None`` skips this batch: no backward, and the next batch is drawn;
            under DDP/FSDP the wrapped model must then not have been called) and a nested dict
            of numbers for the hooks to aggregate and log.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement forward()")

    def build_predict_data_loader(self) -> Iterable[Any]:
        """Return the data ``predict()`` runs ``predict_step`` over (see docs/predict.md).

        Under several ranks, a ``DataLoader`` with a ``DistributedSampler``. No implicit fallback:
        to predict the validation data, return its loader here.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement build_predict_data_loader() to predict")

    def predict_step(self, batch: Any) -> torch.Tensor | dict[str, torch.Tensor]:
        """Compute the outputs of one batch of the predict data (eval mode, no grad, ``self.autocast()``).

        Args:
            batch: A batch drawn from ``build_predict_data_loader()``'s data.

        Returns:
            A tensor, or a dict of str to tensors, whose first dimension is the batch's items
            (saved under ``"predictions"`` for a tensor, under its keys for a dict).
        """
        raise NotImplementedError(f"{type(self).__name__} must implement predict_step() to predict")

    @classmethod
    def missing_methods(cls, kind: str = "train") -> list[str]:
        """The methods of the user's contract this class leaves to the stubs below.

        ``build_optimizer`` is listed when not overridden, though ``settings.optimizer`` can
        stand in for it (the preflight decides).

        Args:
            kind: The run whose methods to list (``"train"``; a ``"predict"`` run needs ``build_model``,
                ``build_predict_data_loader`` and ``predict_step`` only).
        """
        required: tuple[str, ...] = ("build_data_loader", "build_model", "forward", "build_optimizer")
        if kind == "predict":
            required = ("build_model", "build_predict_data_loader", "predict_step")
        return [name for name in required if getattr(cls, name) is getattr(BaseTrainer, name)]

    # -- construction ---------------------------------------------------------------------------

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Refuse a subclass that overrides a run (``train``, ``evaluate``, ``predict``): it would run instead."""
        super().__init_subclass__(**kwargs)
        instead = {
            "train": "what a run trains is forward() and the build_* methods",
            "evaluate": "rename your validation method (e.g. val_metrics) and point ValidationHook(evaluate=...) at "
            "the new name",
            "predict": "what a predict run does per batch is predict_step(), over build_predict_data_loader()'s data",
        }
        for run, say in instead.items():
            if run in vars(cls):
                raise TypeError(f"{cls.__name__}.{run} overrides BaseTrainer.{run}(), the {run} run: {say}")

    def __init__(
        self,
        settings: TrainerSettings | None = None,
        /,
        *,
        state_dict_options: StateDictOptions | None = None,
        logger: Logger | None = None,
        **kwargs: Any,
    ) -> None:
        self.settings = resolve_settings(self.settings_class, settings, kwargs, owner=type(self).__name__)
        self.state_dict_options = state_dict_options
        self.logger = logger if logger is not None else logging.getLogger("trainloop")
        self.device = (
            torch.device(self.settings.device) if self.settings.device else torch.get_default_device()
        )
        if self.settings.optimizers is not None and type(self).build_optimizer is BaseTrainer.build_optimizer:
            check_forward(self.forward, f"{type(self).__name__}.forward()", list(self.settings.optimizers))
        self.run_length = RunLength(self.settings)  # where the run ends: max_steps, max_epochs
        self.metrics = MetricsLog()  # every trainer.log call; metrics.jsonl in the workspace
        self.result: RunResult | None = None
        self._loop = Loop(self)
        self._run: RunState = self._loop.run_state
        self._run.built.update(self.__dict__.pop(EARLY_COMPONENTS, {}))
        self._machine = self._loop.machine
        self._requests = self._loop.requests

    # -- the machine, seen from outside --------------------------------------------------------

    @property
    def state(self) -> State:
        """The machine's current state."""
        return self._machine.state

    @property
    def loop(self) -> Loop:
        """The loop that runs this trainer and owns its run state.

        Machinery: tools such as ``lr_find`` use it; hooks read the trainer instead.
        """
        return self._loop

    @property
    def trace(self) -> Trace | None:
        """The transitions fired so far when ``settings.trace`` is on, else ``None``."""
        return self._machine.trace

    @property
    def max_steps(self) -> int:
        """The run's planned steps.

        ``settings.max_steps``, or fewer when ``max_epochs`` ends it first (see ``RunLength.planned_steps``; known once
        the data loader is built).
        """
        return self.run_length.planned_steps or 0

    @property
    def workspace(self) -> Path | None:
        """``settings.workspace``."""
        return self.settings.workspace

    def on_enter(self, state: State | str, fn: Callable[[BaseTrainer], Any]) -> Handle:
        """Call ``fn(trainer)`` each time the machine enters ``state``."""
        return self._machine.on_enter(state, fn)

    def on_exit(self, state: State | str, fn: Callable[[BaseTrainer], Any]) -> Handle:
        """Call ``fn(trainer)`` each time the machine leaves ``state``."""
        return self._machine.on_exit(state, fn)

    def on_transition(
        self, source: State | str, dest: State | str, fn: Callable[[BaseTrainer], Any]
    ) -> Handle:
        """Call ``fn(trainer)`` each time the machine moves from ``source`` to ``dest``."""
        return self._machine.on_transition(source, dest, fn)

    def on_edge(self, fn: Callable[[BaseTrainer, Transition], Any]) -> Handle:
        """Call ``fn(trainer, transition)`` as every edge fires, before anything it does (see ``StateMachine.on_edge``).

        What runs from one call to the next is the entered state's work: ``ProfilerHook`` wraps each state in a range
        this way. Every edge leaves the fast path while ``fn`` is attached; ``remove()`` the handle when done.
        """
        return self._machine.on_edge(fn)

    def diagram(self, format: str = "mermaid") -> str:
        """The machine as Mermaid (``"mermaid"``) or Graphviz DOT (``"dot"``) source text, or as SVG (``"svg"``)."""
        return self._machine.diagram(format)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The mixed-precision context ``forward`` runs under (a no-op when it is off).

        Use it to evaluate under the same precision as training.
        """
        dtype = _PRECISIONS.get(self.settings.mixed_precision or "")
        return torch.autocast(self.device.type, dtype=dtype) if dtype is not None else NO_CONTEXT

    def request_checkpoint(self) -> None:
        """Ask for a save at the end of the current step: in ``checkpointing``, every saving hook saves.

        A hook's own schedule (``CheckpointingHook(interval=...)``) needs no request; this is for a save out of turn.
        A request made in ``checkpointing`` is met by the saves of that step; one that no save can follow (no
        hook saves, or it is made as the run ends) is said in a warning.
        """
        self._loop.request_checkpoint()

    def request_exit(self, exit_code: int | None = None) -> None:
        """Ask the run to end cleanly at the end of the current step.

        Under a process group the ranks agree first (see ``ExitAgreement``):
        all of them stop after the same step, a little after the first request (about 0.1 s,
        or one step if steps are longer, without a collective on every step).

        Args:
            exit_code: If given, ``train()`` raises ``SystemExit(exit_code)`` once ``exiting``
                has run (a signal exit, for example). Ranks agree on the highest code asked for.
        """
        self._requests.request_exit(exit_code)

    @property
    def exit_requested(self) -> bool:
        """Whether the run will end after this step (on every rank, once the ranks agreed)."""
        return self._requests.exit_agreed

    @property
    def exit_code(self) -> int | None:
        """The exit code agreed on with an exit request, or ``None``."""
        return self._requests.exit_code

    # -- the loop ------------------------------------------------------------------------------

    def train(self) -> RunResult:
        """Run the machine until it reaches ``exiting``.

        In pseudocode (each line is the work of one state, or of an edge's action)::

            building:       build data loader, model, optimizer, lr scheduler, grad scaler, hooks
            restoring:      on_enter_restoring hooks (checkpoint load); on_before_train
            loop:
              begin_step:   (edge) step += 1; on_before_step
              accumulating: draw a batch, forward, backward (under no_sync but the step's last)
              ...again while microsteps remain (accumulating -> accumulating)
              stepping:     unscale, normalise, clip, check gradients; optimizer and scheduler
                            step; on_after_step
              retrying:     (non-finite gradients) zero grads, reset the step's records, count;
                            then redo_step (edge) back to accumulating, the step not advanced
              checkpointing: every save due (the hooks' on_schedule), after on_enter_checkpointing
            exiting:        on_after_train; close the data iterator

        The next state is chosen by ``trainloop.machine.table.TRANSITIONS``; every decision about what
        follows an update (retry, save, exit, next step) leaves from ``stepping``. The work of
        each state is ``trainloop.core.loop.Loop``'s.

        Returns:
            What the run did: its last step, epochs, exit code, last metrics and best
            checkpoint (also kept as ``trainer.result``).

        Raises:
            trainloop.core.preflight.PreflightError: The settings and this trainer class cannot work
                together; nothing was built or written.
            RuntimeError: Gradients stayed non-finite beyond ``max_non_finite_grad_retries``.
            trainloop.core.data.DataExhaustedError: A one-shot iterator ran out before ``max_steps``.
            SystemExit: A hook requested exit with an exit code.
            trainloop.core.workspace.WorkspaceBusyError: Another run holds the workspace; nothing
                was written.
        """
        preflight.check(self)  # before anything is built or written: see trainloop.core.preflight
        with hold_run_workspace(self.settings.workspace, self.logger):  # one run per workspace
            self._run_machine("train")
        if self.exit_code is not None:
            raise SystemExit(self.exit_code)
        assert self.result is not None
        return self.result

    def evaluate(self, checkpoint: str | Path | None = "latest", weights: str = "model") -> dict[str, float]:
        """Run every validation hook once on restored weights, and return their metrics.

        ``building -> restoring -> validating -> exiting``: built as for training, the model's weights
        alone restored, each ``ValidationHook`` run once (no other hook runs), on every rank. Writes
        nothing but its line in ``runs.jsonl``, takes no workspace lock (see ``trainloop.core.run_kinds``).

        Args:
            checkpoint: ``"latest"``: the run's latest complete checkpoint (an error if there is
                none); a checkpoint directory, full or sharded, or a checkpoints root; ``None``:
                the model as built (``settings.init_from`` applied).
            weights: ``"model"``, ``"ema"`` (the EMA hook's averaged weights) or the name of the
                EMA hook whose weights to take.

        Returns:
            The metrics as logged, flattened (``{"val/loss": 0.31}``); also in ``trainer.result``
            (``kind="evaluate"``, ``step``: the checkpoint's).

        Raises:
            trainloop.core.run_kinds.EvaluateError: No ValidationHook.
            trainloop.checkpoint.errors.CheckpointError: No checkpoint to restore, or one that
                cannot be read or does not fit the model.
        """
        source = WeightsSource.of(checkpoint, weights)
        preflight.check(self)
        self._run_machine("evaluate", source)
        assert self.result is not None
        return dict(self.result.metrics)

    def predict(
        self, checkpoint: str | Path | None = "latest", weights: str = "model", output: str | Path | None = None
    ) -> dict[str, torch.Tensor]:
        """Predict every item of ``build_predict_data_loader()``'s data once, and write the outputs in dataset order.

        The path is ``building`` (predict data and model only) ``-> restoring -> predicting -> exiting``:
        the outputs of every rank gathered, a ``DistributedSampler``'s padding dropped, item ``i``
        at row ``i``; rank 0 writes one file atomically, replacing an existing one. Nothing else
        is written but the run's ``runs.jsonl`` line (``"kind": "predict"``); no workspace lock is
        taken. See docs/predict.md.

        Args:
            checkpoint: ``"latest"``: the run's latest checkpoint (as ``evaluate()``); a
                checkpoint directory, full or sharded (or a checkpoints root, or a workspace);
                ``None``: the model as built (with ``settings.init_from``'s weights if declared).
            weights: ``"model"``, ``"ema"`` (the one EMA hook's averaged weights) or the name of
                the EMA hook whose weights to use.
            output: The file to write, ``.safetensors`` or ``.pt``/``.pth``; by default
                ``<workspace>/predictions.safetensors`` (nothing is written without a workspace).

        Returns:
            The outputs by name (``"predictions"`` when ``predict_step`` returns one tensor),
            row ``i`` being item ``i`` of the dataset, on every rank (CPU tensors).

        Raises:
            ValueError: ``output`` is not a ``.safetensors`` or ``.pt`` file; nothing was built.
            trainloop.core.run_kinds.EvaluateError: ``weights`` given without a checkpoint; nothing was built.
            trainloop.core.preflight.PreflightError: The trainer cannot predict (no
                ``predict_step`` or ``build_predict_data_loader``) or the settings cannot run.
            trainloop.checkpoint.CheckpointError: The checkpoint is missing, corrupt or lacks the weights.
            trainloop.predict.outputs.PredictionError: ``predict_step`` returned something else
                than a tensor or a dict of tensors per item; the error names the batch.
            trainloop.predict.order.PredictDataError: The data cannot give every item once in a known order.
        """
        source = WeightsSource.of(checkpoint, weights)
        path = predictions_path(output, self.workspace)
        preflight.check(self, kind="predict")
        predict_run = PredictRun(self, self._run, source, path)
        self._run_machine("predict", source, predict_run)
        return predict_run.outputs

    def _run_machine(
        self, kind: RunKind, source: WeightsSource | None = None, predict_run: PredictRun | None = None
    ) -> None:
        """Run the machine once, for a run of ``kind``; the result is kept in ``self.result``."""
        if self.state is not State.IDLE:
            raise RuntimeError(
                f"{kind}() runs once per trainer (one run of any kind: train, "
                f"evaluate, predict); this one is in state {self.state.value!r}: make a new trainer"
            )
        started = time.time()
        try:
            self._loop.run(kind, source, predict_run.work() if predict_run is not None else None)
        except BaseException as error:  # raised again as it is, its traceback trimmed to what the user needs
            error.__traceback__ = user_traceback(error.__traceback__)
            raise
        finally:
            # A run that trains nothing refused before its weights were restored is not a run.
            self.result = finish_run(self, kind, write=self._loop.of_kind.recorded, started=started)

    # -- state -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The full training state.

        Model, optimizer, scheduler, grad scaler, step, per-rank random generators and data position, settings, and
        hooks' (see ``trainloop.core.training_state``).
        """
        return training_state(self, self._run)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned (the step and epoch included)."""
        load_training_state(self, self._run, state_dict)

    # -- logging and helpers -------------------------------------------------------------------

    def log(self, records: Records) -> None:
        """Send nested numeric records to every hook's ``on_log``, and record them in ``trainer.metrics``.

        They are also written to ``<workspace>/metrics.jsonl`` (see ``settings.metrics_file``).
        """
        run = self._run
        self.metrics.record(run.step, records)
        for fn in run.dispatch["on_log"]:
            fn(self, records)

    def log_images(self, records: dict[str, Any]) -> None:
        """Send images (e.g. PIL images) to every hook's ``on_log_images``."""
        for fn in self._run.dispatch["on_log_images"]:
            fn(self, records)

    @staticmethod
    def unwrap(module: nn.Module) -> nn.Module:
        """See through ``torch.compile``, DDP, DataParallel and ``AveragedModel``."""
        return unwrap_model(module)

    @property
    def optimizers(self) -> dict[str, torch.optim.Optimizer]:
        """The built optimizers by name, in the order a step updates them (one: ``{"default": optimizer}``)."""
        return self._run.optimizers

    @property
    def updating(self) -> str:
        """The name of the optimizer whose update is in progress (``"default"`` for a run's one optimizer)."""
        return self._run.updating

    @property
    def lr_schedulers(self) -> dict[str, torch.optim.lr_scheduler.LRScheduler]:
        """The built lr schedulers by their optimizer's name (an optimizer without one is absent)."""
        return self._run.lr_schedulers

    @property
    def unwrapped_model(self) -> nn.Module:
        """``self.model`` without its wrappers."""
        return unwrap_model(self.model)


