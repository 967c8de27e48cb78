"""``BaseTrainer``: the user's contract, and the work done in each state of the machine."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable
from logging import Logger
from pathlib import Path
from time import perf_counter
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from . import components
from .agreement import ExitAgreement
from .data import EpochIterator
from .hooks.base import BaseHook, hook_dispatch, state_entry_methods
from .loss import Loss
from .machine import Handle, State, StateMachine
from .rng import seed_all, set_rng_state
from .settings import TrainerSettings
from .step import LossNoneWarning, StepPlan, StepRunner
from .trace import Trace
from .training_state import ChangedSettingsWarning, load_training_state, training_state
from .utils import Records, is_rank_zero, unwrap_model

if TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

__all__ = ["BaseTrainer", "ChangedSettingsWarning", "LossNoneWarning"]

_NO_CONTEXT = contextlib.nullcontext()  # reusable: entering it allocates nothing
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

    def __init__(
        self,
        settings: TrainerSettings | None = None,
        /,
        *,
        state_dict_options: StateDictOptions | None = None,
        logger: Logger | None = None,
        **kwargs: Any,
    ) -> None:
        self.settings = self._resolve_settings(settings, kwargs)
        self.state_dict_options = state_dict_options
        self.logger = logger if logger is not None else logging.getLogger("trainloop")
        self.device = (
            torch.device(self.settings.device) if self.settings.device else torch.get_default_device()
        )
        self.step = 0  # the last begun step; incremented when a new step begins
        self.epoch = 0
        self.step_info: dict[str, Any] = {}
        self.hooks: list[BaseHook] = []
        self.error: BaseException | None = None
        self.exit_code: int | None = None
        self._dispatch = hook_dispatch(())
        self._checkpoint_requested = False
        self._checkpoint_at_exit = False
        self._last_checkpoint_step: int | None = None
        self._exit_request = 0  # this rank's: 0 none, else 1 + exit code
        self._exit_requested = False  # agreed by all ranks
        self._retries = 0  # retries of the step in progress
        self._applied = True  # whether the last optimizer update was applied
        self._data: EpochIterator | None = None
        self._runner: StepRunner | None = None
        self._agreement: ExitAgreement | None = None
        self._restored_rng: dict[str, Any] | None = None
        self._machine = StateMachine(
            conditions={
                "should_exit": self._should_exit,
                "microsteps_remain": self._microsteps_remain,
                "grads_non_finite": self._grads_are_non_finite,
                "checkpoint_due": self._checkpoint_due,
            },
            actions={"begin_step": self._begin_step, "redo_step": self._redo_step},
            owner=self,
            step=lambda: self.step,
        )

    def _resolve_settings(self, settings: TrainerSettings | None, overrides: dict[str, Any]) -> TrainerSettings:
        cls = self.settings_class
        if settings is None:
            return cls(**overrides)
        if not isinstance(settings, TrainerSettings):
            raise TypeError(
                f"{type(self).__name__}() takes a TrainerSettings as its only positional argument, "
                f"got {type(settings).__name__}; pass the other settings as keywords "
                "(e.g. max_steps=1000)"
            )
        if isinstance(settings, cls) and not overrides:
            return settings
        return cls.model_validate({**settings.model_dump(), **overrides})

    # -- the user's contract -------------------------------------------------------------------

    def build_data_loader(self) -> Iterable[Any]:
        """Return the training data: an infinite iterator or a re-iterable such as a DataLoader."""
        raise NotImplementedError(f"{type(self).__name__} must implement build_data_loader()")

    def build_model(self) -> nn.Module:
        """Return the model, on its device and already wrapped (DDP, FSDP) if wanted."""
        raise NotImplementedError(f"{type(self).__name__} must implement build_model()")

    def build_optimizer(self) -> torch.optim.Optimizer:
        """Return the optimizer of ``self.model``'s parameters.

        By default, the one declared in ``settings.optimizer``.
        """
        if self.settings.optimizer is None:
            raise NotImplementedError(
                f"{type(self).__name__} must implement build_optimizer() or declare settings.optimizer"
            )
        return components.build_optimizer(self.settings.optimizer, self.model)

    def build_lr_scheduler(self) -> torch.optim.lr_scheduler.LRScheduler | None:
        """Return a learning-rate scheduler stepped after every optimizer step, or ``None``.

        By default, the one declared in ``settings.lr_schedule``, if any.
        """
        if self.settings.lr_schedule is None:
            return None
        return components.build_lr_scheduler(self.settings.lr_schedule, self.optimizer, self.settings.max_steps)

    def build_grad_scaler(self) -> torch.amp.GradScaler:
        """Return the gradient scaler; by default enabled for fp16 mixed precision only."""
        return torch.amp.GradScaler(self.device.type, enabled=self.settings.mixed_precision == "fp16")

    def build_hooks(self) -> list[BaseHook]:
        """Return the hooks of this run, in the order they are called.

        By default, the hooks declared in ``settings.hooks``.
        """
        return [spec.build() for spec in self.settings.hooks]

    def forward(self, input: Any) -> tuple[torch.Tensor | None, Records]:
        """Compute the loss of one microstep's batch.

        Args:
            input: A batch drawn from the data loader.

        Returns:
            The scalar loss (``None`` skips this batch: no backward, and the next batch is drawn;
            under DDP/FSDP the wrapped model must then not have been called) and a nested dict
            of numbers for the hooks to aggregate and log.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement forward()")

    # -- the machine, seen from outside --------------------------------------------------------

    @property
    def state(self) -> State:
        """The machine's current state."""
        return self._machine.state

    @property
    def trace(self) -> Trace | None:
        """The transitions fired so far when ``settings.trace`` is on, else ``None``."""
        return self._machine.trace

    @property
    def max_steps(self) -> int:
        """``settings.max_steps``."""
        return self.settings.max_steps

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

    def diagram(self, format: str = "mermaid") -> str:
        """The machine as Mermaid (``"mermaid"``) or Graphviz DOT (``"dot"``) source text."""
        return self._machine.diagram(format)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The mixed-precision context ``forward`` runs under (a no-op when it is off).

        Use it to evaluate under the same precision as training.
        """
        dtype = _PRECISIONS.get(self.settings.mixed_precision or "")
        return torch.autocast(self.device.type, dtype=dtype) if dtype is not None else _NO_CONTEXT

    def request_checkpoint(self, at_exit: bool = False) -> None:
        """Ask for a checkpoint at the end of the current step (the machine enters ``checkpointing``).

        Args:
            at_exit: Instead, a standing request: checkpoint whenever the run ends cleanly
                (``max_steps`` reached or an exit requested), unless this step was just saved.
                A run that ends by an error is not saved.
        """
        if at_exit:
            self._checkpoint_at_exit = True
        else:
            self._checkpoint_requested = True

    def request_exit(self, exit_code: int | None = None) -> None:
        """Ask the run to end cleanly at the end of the current step.

        Under a process group the ranks agree first (see ``ExitAgreement``):
        all of them stop after the same step, one step after the first request.

        Args:
            exit_code: If given, ``train()`` raises ``SystemExit(exit_code)`` once ``exiting``
                has run (a signal exit, for example). Ranks agree on the highest code asked for.
        """
        self._exit_request = max(self._exit_request, 1 + (exit_code or 0))

    @property
    def exit_requested(self) -> bool:
        """Whether the run will end after this step (on every rank, once the ranks agreed)."""
        return self._exit_requested

    # -- the loop ------------------------------------------------------------------------------

    def train(self) -> None:
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
              checkpointing: on_enter_checkpointing hooks save
            exiting:        on_after_train; close the data iterator

        The next state is chosen by ``trainloop.machine.TRANSITIONS``; every decision about what
        follows an update (retry, save, exit, next step) leaves from ``stepping``.

        Raises:
            RuntimeError: Gradients stayed non-finite beyond ``max_non_finite_grad_retries``.
            trainloop.data.DataExhaustedError: A one-shot iterator ran out before ``max_steps``.
            SystemExit: A hook requested exit with an exit code.
        """
        if self.state is not State.IDLE:
            raise RuntimeError(f"train() runs once per trainer; this one is in state {self.state.value!r}")
        machine = self._machine
        work: dict[State, Callable[[], None]] = {
            State.BUILDING: self._build,
            State.RESTORING: self._restore,
            State.ACCUMULATING: self._accumulate,
            State.STEPPING: self._update,
            State.RETRYING: self._retry,
            State.CHECKPOINTING: self._checkpoint,
        }
        self._record_run()
        try:
            state = machine.advance()
            while state is not State.EXITING:
                work[state]()
                state = machine.advance()
        except BaseException as error:
            self.error = error
            machine.fail()
            raise
        finally:
            self._exit()
        if self.exit_code is not None:
            raise SystemExit(self.exit_code)

    def _record_run(self) -> None:
        """Write the resolved settings, and open the trace, in the workspace (rank 0)."""
        workspace = self.settings.workspace if is_rank_zero() else None
        if workspace is not None:
            workspace.mkdir(parents=True, exist_ok=True)
            tmp = workspace / ".settings.json.tmp"
            tmp.write_text(self.settings.model_dump_json(indent=2) + "\n", encoding="utf-8")
            tmp.replace(workspace / "settings.json")
        if self.settings.trace:
            self._machine.trace = Trace(workspace / "trace.jsonl" if workspace is not None else None)

    # -- the work of each state ----------------------------------------------------------------

    def _build(self) -> None:
        self._build_components()
        self.lr_scheduler = self.build_lr_scheduler()
        self.grad_scaler = self.build_grad_scaler()
        self.hooks = list(self.build_hooks())
        _name_hooks(self.hooks)
        self._dispatch = hook_dispatch(self.hooks)
        for hook in self.hooks:
            for state, method in state_entry_methods(hook):
                self._machine.on_enter(state, method)

    def _build_components(self) -> None:
        """Seed, then build data loader, model and optimizer, in that order (each may read the
        ones before it); ``lr_find`` builds these alone."""
        if self.settings.seed is not None:
            seed_all(self.settings.seed)
        self.data_loader = self.build_data_loader()
        self.model = self.build_model()
        self.optimizer = self.build_optimizer()

    def _restore(self) -> None:
        # A checkpoint, if any, was loaded by on_enter_restoring callbacks before this runs.
        for fn in self._dispatch["on_before_train"]:
            fn(self)
        self._data = EpochIterator(self.data_loader, self.epoch, resumed=self.step > 0)
        if self._restored_rng is not None:
            # Only now: creating the data iterator draws from torch's generator (its base seed),
            # which the uninterrupted run did long before this step.
            set_rng_state(self._restored_rng)
            self._restored_rng = None
        self._runner = StepRunner(self._step_plan(), self._data)
        self._agreement = ExitAgreement()
        self.model.train()
        self.optimizer.zero_grad()

    def _step_plan(self) -> StepPlan:
        """Everything the hot loop would otherwise look up per microstep, resolved once."""
        settings = self.settings
        return StepPlan(
            model=self.model,
            optimizer=self.optimizer,
            forward=self.forward,
            owner=f"{type(self).__name__}.forward()",
            accumulation=settings.gradient_accumulation_steps,
            grad_clip=settings.grad_clip,
            grad_scaler=self.grad_scaler,
            lr_scheduler=self.lr_scheduler,
            check_grads=settings.detect_non_finite_grads,
            no_sync=settings.no_sync_accumulate,
            autocast=self.autocast(),  # reused: an autocast object can be entered again
            before_optimizer_step=self._before_optimizer_step if self._dispatch["on_before_optimizer_step"] else None,
        )

    def _before_optimizer_step(self) -> None:
        for fn in self._dispatch["on_before_optimizer_step"]:
            fn(self)

    # -- the edges' actions --------------------------------------------------------------------

    def _begin_step(self) -> None:
        """``begin_step``: a new step, counted, announced to ``on_before_step``."""
        self.step += 1
        self._retries = 0
        self.step_info = {"data_time": [], "loss": [], "records": [], "non_finite_grad_retries": 0}
        self._step_start = perf_counter()
        self._runner.begin()  # type: ignore[union-attr]
        for fn in self._dispatch["on_before_step"]:
            fn(self)

    def _redo_step(self) -> None:
        """``redo_step``: the same step again, on fresh batches; neither counted nor announced."""
        self._runner.begin()  # type: ignore[union-attr]

    # -- the work of each state, continued -------------------------------------------------------

    def _accumulate(self) -> None:
        loss, records, data_time = self._runner.microstep()  # type: ignore[union-attr]
        info = self.step_info
        info["data_time"].append(data_time)
        info["records"].append(records)
        info["loss"].append(loss.sum.detach() / loss.count if isinstance(loss, Loss) else loss.detach())

    def _update(self) -> None:
        runner = self._runner
        self._applied = runner.update()  # type: ignore[union-attr]
        if self.settings.grad_clip is not None:
            self.step_info["grad_norm"] = runner.grad_norm  # type: ignore[union-attr]
        if not self._applied:
            self._check_retries_left()
            return
        self.step_info["step_time"] = perf_counter() - self._step_start
        for fn in self._dispatch["on_after_step"]:
            fn(self)
        self._settle_requests()

    def _settle_requests(self) -> None:
        agreed = self._agreement.settle(self._exit_request)  # type: ignore[union-attr]
        if agreed:
            self._exit_requested = True
            if agreed > 1:
                self.exit_code = agreed - 1

    def _check_retries_left(self) -> None:
        limit = self.settings.max_non_finite_grad_retries or 0
        if self._retries < limit:
            return
        scale = (
            f"; the grad scaler's scale is now {self.grad_scaler.get_scale():g} (raise "
            "max_non_finite_grad_retries to let it settle lower)"
            if self.grad_scaler.is_enabled() else ""
        )
        if limit == 0:
            raise RuntimeError(
                f"non-finite gradients at step {self.step}; max_non_finite_grad_retries is "
                f"{self.settings.max_non_finite_grad_retries}, so the step is not retried{scale}"
            )
        raise RuntimeError(
            f"non-finite gradients at step {self.step} after {self._retries} retries "
            f"(max_non_finite_grad_retries={limit}){scale}"
        )

    def _retry(self) -> None:
        self._retries += 1
        self.logger.warning(
            "Non-finite gradients at step %d; retrying (%d/%d)",
            self.step, self._retries, self.settings.max_non_finite_grad_retries,
        )
        self.optimizer.zero_grad()
        info = self.step_info
        info["loss"], info["records"] = [], []
        info["non_finite_grad_retries"] = self._retries

    def _checkpoint(self) -> None:
        # The save itself is done by on_enter_checkpointing callbacks (CheckpointingHook).
        self._checkpoint_requested = False
        self._last_checkpoint_step = self.step

    def _exit(self) -> None:
        if self.trace is not None:
            self.trace.close()
        try:
            for fn in self._dispatch["on_after_train"]:
                fn(self)
        finally:
            if self._agreement is not None:
                self._agreement.close()
            if self._data is not None:
                self._data.close()
                self.epoch = self._data.epoch

    # -- the machine's policies ----------------------------------------------------------------

    def _should_exit(self) -> bool:
        return self._exit_requested or self.step >= self.settings.max_steps

    def _microsteps_remain(self) -> bool:
        return self._runner.microsteps < self.settings.gradient_accumulation_steps  # type: ignore[union-attr]

    def _grads_are_non_finite(self) -> bool:
        return not self._applied

    def _checkpoint_due(self) -> bool:
        return self._checkpoint_requested or (
            self._checkpoint_at_exit and self._last_checkpoint_step != self.step and self._should_exit()
        )

    # -- state -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The full training state: model, optimizer, scheduler, grad scaler, step, per-rank
        random generators and data position, settings, and hooks' (see
        ``trainloop.training_state``)."""
        return training_state(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""
        load_training_state(self, state_dict)

    # -- logging and helpers -------------------------------------------------------------------

    def log(self, records: Records, dry_run: bool = False) -> None:
        """Send nested numeric records to every hook's ``on_log``."""
        for fn in self._dispatch["on_log"]:
            fn(self, records, dry_run=dry_run)

    def log_images(self, records: dict[str, Any], dry_run: bool = False) -> None:
        """Send images (e.g. PIL images) to every hook's ``on_log_images``."""
        for fn in self._dispatch["on_log_images"]:
            fn(self, records, dry_run=dry_run)

    @staticmethod
    def unwrap(module: nn.Module) -> nn.Module:
        """See through ``torch.compile``, DDP, DataParallel and ``AveragedModel``."""
        return unwrap_model(module)

    @property
    def unwrapped_model(self) -> nn.Module:
        """``self.model`` without its wrappers."""
        return unwrap_model(self.model)


def _name_hooks(hooks: list[BaseHook]) -> None:
    """Check the hooks' types and make their names unique (``name``, ``name_2``, ...)."""
    seen: dict[str, int] = {}
    for i, hook in enumerate(hooks):
        if not isinstance(hook, BaseHook):
            raise TypeError(f"build_hooks() item {i} is a {type(hook).__name__}, not a BaseHook")
        base = hook.name
        seen[base] = seen.get(base, 0) + 1
        if seen[base] > 1:
            hook.name = f"{base}_{seen[base]}"

