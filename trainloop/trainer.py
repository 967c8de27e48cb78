"""``BaseTrainer``: the user's contract, and the work done in each state of the machine."""

from __future__ import annotations

import contextlib
import json
import logging
import warnings
from collections.abc import Callable, Iterable, Mapping
from logging import Logger
from pathlib import Path
from time import perf_counter
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from . import components
from .agreement import ExitAgreement
from .data import EpochIterator
from .grads import NonFiniteGradCheck
from .hooks.base import BaseHook, hook_dispatch, state_entry_methods
from .limits import RunLength
from .loss import Loss
from .machine import Handle, State, StateMachine
from .metrics import METRICS_FILE, MetricsLog
from .result import RunResult, finish_run
from .rng import get_rng_state, seed_all, set_rng_state
from .settings import TrainerSettings
from .sync import gradient_sync
from .trace import Trace
from .utils import Records, is_distributed_model, is_rank_zero, unwrap_model

if TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

__all__ = ["BaseTrainer", "ChangedSettingsWarning", "LossNoneWarning"]

_NO_CONTEXT = contextlib.nullcontext()  # reusable: entering it allocates nothing
_PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16}


class ChangedSettingsWarning(UserWarning):
    """A run resumes from a checkpoint made with different settings."""


class LossNoneWarning(UserWarning):
    """``forward`` returned ``loss=None`` while the model is wrapped by DDP or FSDP."""


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
        self.run_length = RunLength(self.settings)  # where the run ends: max_steps, max_epochs
        self.metrics = MetricsLog()  # every trainer.log call; metrics.jsonl in the workspace
        self.result: RunResult | None = None
        self._dispatch = hook_dispatch(())
        self._checkpoint_requested = False
        self._checkpoint_at_exit = False
        self._last_checkpoint_step: int | None = None
        self._exit_request = 0  # this rank's: 0 none, else 1 + exit code
        self._exit_requested = False  # agreed by all ranks
        self._microstep = 0  # microsteps completed in the current step
        self._items: torch.Tensor | int | None = None  # the step's Loss item count so far
        self._retries = 0
        self._retrying = False
        self._grads_non_finite = False
        self._data: EpochIterator | None = None
        self._agreement: ExitAgreement | None = None
        self._restored_rng: dict[str, Any] | None = None
        self._machine = StateMachine(
            conditions={
                "should_exit": self._should_exit,
                "microsteps_remain": self._microsteps_remain,
                "grads_non_finite": self._grads_are_non_finite,
                "checkpoint_due": self._checkpoint_due,
            },
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
        return components.build_lr_scheduler(self.settings.lr_schedule, self.optimizer, self.max_steps)

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
        """The run's planned steps: ``settings.max_steps``, or fewer when ``max_epochs`` ends it
        first (see ``RunLength.planned_steps``; known once the data loader is built)."""
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

    def train(self) -> RunResult:
        """Run the machine until it reaches ``exiting``.

        In pseudocode (each line is the work of one state)::

            building:       build data loader, model, optimizer, lr scheduler, grad scaler, hooks
            restoring:      on_enter_restoring hooks (checkpoint load); on_before_train
            loop:
              stepping:     step += 1 (not on a retry); on_before_step; microstep
              accumulating: microstep (under no_sync, except for the last one)
              ...after the last microstep: check gradients; optimizer, scheduler; on_after_step
              retrying:     zero grads, reset the step's losses and records
              checkpointing: on_enter_checkpointing hooks save
            exiting:        on_after_train; close the data iterator

        The next state is chosen by ``trainloop.machine.TRANSITIONS``.

        Returns:
            What the run did: its last step, epochs, exit code, last metrics and best
            checkpoint (also kept as ``trainer.result``).

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
            State.STEPPING: self._begin_step,
            State.ACCUMULATING: self._microstep_once,
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
            self.result = finish_run(self)  # also appended to <workspace>/runs.jsonl
        if self.exit_code is not None:
            raise SystemExit(self.exit_code)
        return self.result

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
        self.run_length.plan(self.data_loader)
        self.model = self.build_model()
        self.optimizer = self.build_optimizer()

    def _restore(self) -> None:
        # A checkpoint, if any, was loaded by on_enter_restoring callbacks before this runs.
        if self.settings.metrics_file and self.settings.workspace is not None and is_rank_zero():
            self.metrics.open(self.settings.workspace / METRICS_FILE, resumed_step=self.step)
        for fn in self._dispatch["on_before_train"]:
            fn(self)
        self._prepare_step_constants()
        self._data = EpochIterator(self.data_loader, self.epoch, resumed=self.step > 0)
        self.run_length.follow(self._data)
        if self._restored_rng is not None:
            # Only now: creating the data iterator draws from torch's generator (its base seed),
            # which the uninterrupted run did long before this step.
            set_rng_state(self._restored_rng)
            self._restored_rng = None
        self._agreement = ExitAgreement()
        self.model.train()
        self.optimizer.zero_grad()

    def _prepare_step_constants(self) -> None:
        """Resolve, once, everything the hot loop would otherwise look up per microstep."""
        settings = self.settings
        self._accumulation = settings.gradient_accumulation_steps
        self._scaling = self.grad_scaler.is_enabled()
        self._autocast = self.autocast()  # reused: an autocast object can be entered again
        # Built once, entered on every microstep but a step's last: DDP's no_sync(), FSDP2's
        # set_requires_gradient_sync(False).
        sync_off = gradient_sync(self.model, enabled=False)
        self._sync_off = sync_off if settings.no_sync_accumulate and sync_off.controls_sync else None
        self._distributed_model = is_distributed_model(self.model)  # it also averages gradients over ranks
        # GradScaler finds non-finite gradients itself (and skips the step), so no check then.
        self._grad_check = (
            NonFiniteGradCheck(self.model.parameters())
            if settings.detect_non_finite_grads and not self._scaling and settings.grad_clip is None
            else None
        )
        self._check_grads = settings.detect_non_finite_grads and not self._scaling

    def _begin_step(self) -> None:
        if self._retrying:
            self._retrying = False
        else:
            self.step += 1
            self._retries = 0
            self.step_info = {"data_time": [], "loss": [], "records": [], "non_finite_grad_retries": 0}
            self._step_start = perf_counter()
            for fn in self._dispatch["on_before_step"]:
                fn(self)
        self._microstep = 0
        self._items = None
        self._grads_non_finite = False
        self._microstep_once()

    def _microstep_once(self) -> None:
        last = self._microstep + 1 == self._accumulation
        with self._sync_off if self._sync_off is not None and not last else _NO_CONTEXT:
            loss = self._forward_until_loss()
            if self._scaling:
                loss = self.grad_scaler.scale(loss)
            loss.backward()
        self._microstep += 1
        if last:
            self._finish_step()

    def _forward_until_loss(self) -> torch.Tensor:
        """Draw batches until ``forward`` returns a loss; record it, return what to backpropagate.

        A ``None`` loss does not count. A plain loss is divided by the number of microsteps; a
        ``Loss`` is backpropagated as its sum and its count added up, for
        ``_normalise_by_items`` to divide the gradients by at the end of the step.
        """
        info = self.step_info
        while True:
            start = perf_counter()
            batch = next(self._data)  # type: ignore[arg-type]
            info["data_time"].append(perf_counter() - start)
            with self._autocast:
                output = self.forward(batch)
            try:
                loss, records = output
            except (TypeError, ValueError):
                raise TypeError(
                    f"{type(self).__name__}.forward() must return (loss, records), "
                    f"got {type(output).__name__}"
                ) from None
            if records is None:
                records = {}
            elif type(records) is not dict and not isinstance(records, Mapping):
                raise TypeError(
                    f"{type(self).__name__}.forward() must return records as a dict of numbers "
                    f"(or None), got {type(records).__name__}"
                )
            if loss is not None:
                break
            if self._distributed_model:
                warnings.warn(
                    "forward() returned loss=None under DDP/FSDP; the wrapped model must not have "
                    "been called for this batch, or its next backward may hang or be wrong",
                    LossNoneWarning,
                    stacklevel=2,
                )
        info["records"].append(records)
        if isinstance(loss, Loss):
            _check_scalar(self, loss.sum, "Loss.sum")
            if self._microstep and self._items is None:
                raise TypeError(f"{type(self).__name__}.forward() mixed plain losses and Loss(sum, count) in one step")
            self._items = loss.count if self._items is None else self._items + loss.count
            info["loss"].append(loss.sum.detach() / loss.count)
            return loss.sum
        _check_scalar(self, loss, "loss")
        if self._items is not None:
            raise TypeError(f"{type(self).__name__}.forward() mixed plain losses and Loss(sum, count) in one step")
        info["loss"].append(loss.detach())
        return loss / self._accumulation if self._accumulation > 1 else loss

    def _finish_step(self) -> None:
        """After the last microstep: unscale, clip, check gradients, step, schedule."""
        optimizer = self.optimizer
        if self._scaling:
            self.grad_scaler.unscale_(optimizer)
        if self._items is not None:
            self._normalise_by_items()
        for fn in self._dispatch["on_before_optimizer_step"]:
            fn(self)
        grad_clip = self.settings.grad_clip
        if grad_clip is not None:
            grad_norm = nn.utils.clip_grad_norm_(self.model.parameters(), grad_clip)
            if hasattr(grad_norm, "full_tensor"):  # an FSDP2 DTensor, replicated: no communication
                grad_norm = grad_norm.full_tensor()
            self.step_info["grad_norm"] = grad_norm
        if self._check_grads:
            # The step's one host sync: a retry must be decided before the optimizer steps.
            # With clipping on, the total norm is finite iff every gradient is.
            non_finite = (
                self._grad_check() if self._grad_check is not None else not bool(torch.isfinite(grad_norm))
            )
            if non_finite:
                self._on_non_finite_grads()
                return
        if self._scaling:
            self.grad_scaler.step(optimizer)
            self.grad_scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad()
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.step_info["step_time"] = perf_counter() - self._step_start
        for fn in self._dispatch["on_after_step"]:
            fn(self)
        self._settle_requests()

    def _normalise_by_items(self) -> None:
        """Divide the step's summed gradients by its item count, over all ranks of a DDP/FSDP model."""
        items = torch.as_tensor(self._items, dtype=torch.float32, device=self.device)
        factor = 1.0 / items
        if self._distributed_model and dist.is_initialized():
            items = items.clone()
            dist.all_reduce(items)  # the total over ranks; stays on the device
            factor = dist.get_world_size() / items
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        torch._foreach_mul_(grads, factor)  # a tensor factor: no host sync
        self._items = None

    def _settle_requests(self) -> None:
        agreed = self._agreement.settle(self._exit_request)
        if agreed:
            self._exit_requested = True
            if agreed > 1:
                self.exit_code = agreed - 1

    def _on_non_finite_grads(self) -> None:
        limit = self.settings.max_non_finite_grad_retries or 0
        if self._retries >= limit:
            if limit == 0:
                raise RuntimeError(
                    f"non-finite gradients at step {self.step}; max_non_finite_grad_retries is "
                    f"{self.settings.max_non_finite_grad_retries}, so the step is not retried"
                )
            raise RuntimeError(
                f"non-finite gradients at step {self.step} after {self._retries} retries "
                f"(max_non_finite_grad_retries={limit})"
            )
        self._grads_non_finite = True

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
        self._retrying = True

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
            self.metrics.close()
            if self._agreement is not None:
                self._agreement.close()
            if self._data is not None:
                self._data.close()
                self.epoch = self._data.epoch

    # -- the machine's policies ----------------------------------------------------------------

    def _should_exit(self) -> bool:
        return self._exit_requested or self.run_length.reached(self.step)

    def _microsteps_remain(self) -> bool:
        return self._microstep < self._accumulation

    def _grads_are_non_finite(self) -> bool:
        return self._grads_non_finite

    def _checkpoint_due(self) -> bool:
        return self._checkpoint_requested or (
            self._checkpoint_at_exit and self._last_checkpoint_step != self.step and self._should_exit()
        )

    # -- state -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The full training state: model, optimizer, scheduler, grad scaler, step, and hooks'.

        Model and optimizer go through ``torch.distributed.checkpoint.state_dict`` so DDP and
        FSDP models give the same layout as plain ones.
        """
        # Imported here: torch.distributed.checkpoint costs ~0.8 s to import, and many runs never save.
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(
            self.model, self.optimizer, options=self.state_dict_options
        )
        state_dict: dict[str, Any] = {
            "model": model_state,
            "training_state": {
                "step": self.step,
                "epoch": self._data.resume_epoch if self._data is not None else self.epoch,
                "optimizer": optimizer_state,
                "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler else None,
                "grad_scaler": self.grad_scaler.state_dict(),
                # What resumes the run exactly, per rank (each rank has its own).
                "rng": _per_rank(get_rng_state()),
                "data_loader": _per_rank(_loader_state(self.data_loader)),
                # JSON, never pickled: readable anywhere, and compared on resume.
                "settings": self.settings.model_dump_json(),
            },
        }
        for fn in self._dispatch["on_state_dict"]:
            fn(self, state_dict)
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""
        from torch.distributed.checkpoint.state_dict import set_state_dict

        training_state = state_dict["training_state"]
        self.step = training_state["step"]
        self.epoch = training_state.get("epoch", 0)
        self.logger.info("Resuming from step %d", self.step)
        if self.lr_scheduler is not None:
            # The scheduler must load before the optimizer: loading it rewrites the optimizer's
            # lr with its own (pytorch/pytorch#119168).
            self.lr_scheduler.load_state_dict(training_state["lr_scheduler"])
        self.grad_scaler.load_state_dict(training_state["grad_scaler"])
        self._restore_per_rank(training_state)
        self._warn_on_changed_settings(training_state.get("settings"))
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state_dict["model"],
            optim_state_dict=training_state["optimizer"],
            options=self.state_dict_options,
        )
        for fn in self._dispatch["on_load_state_dict"]:
            fn(self, state_dict)

    def _restore_per_rank(self, training_state: dict[str, Any]) -> None:
        """Restore this rank's generators and data position, if saved for as many ranks."""
        rngs, loaders = training_state.get("rng"), training_state.get("data_loader")
        rank, world = _rank_and_world()
        if rngs is None or len(rngs) != world:
            if rngs is not None:
                self.logger.warning(
                    "The checkpoint holds random states of %d ranks and this run has %d: they are "
                    "not restored, so the resumed run is not an exact continuation", len(rngs), world,
                )
            return
        if self._data is None:
            self._restored_rng = rngs[rank]  # applied once the data iterator exists
        else:
            set_rng_state(rngs[rank])
        if loaders is not None and loaders[rank] is not None:
            self.data_loader.load_state_dict(loaders[rank])

    def _warn_on_changed_settings(self, saved: str | None) -> None:
        if saved is None:
            return
        then = json.loads(saved)
        now = json.loads(self.settings.model_dump_json())
        changed = sorted(k for k in then.keys() | now.keys() if then.get(k) != now.get(k))
        if changed:
            warnings.warn(
                f"resuming with settings that differ from the checkpoint's: {', '.join(changed)}",
                ChangedSettingsWarning,
                stacklevel=2,
            )

    # -- logging and helpers -------------------------------------------------------------------

    def log(self, records: Records, dry_run: bool = False) -> None:
        """Send nested numeric records to every hook's ``on_log``, and record them in
        ``trainer.metrics`` (and ``<workspace>/metrics.jsonl``, see ``settings.metrics_file``)."""
        if not dry_run:
            self.metrics.record(self.step, records)
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


def _check_scalar(trainer: BaseTrainer, loss: Any, what: str) -> None:
    if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
        got = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise TypeError(f"{type(trainer).__name__}.forward() must return a scalar tensor {what}, got {got}")


def _loader_state(loader: Any) -> Any:
    """The loader's position when it can report one (``StatefulDataLoader``), else ``None``."""
    state_dict = getattr(loader, "state_dict", None)
    return state_dict() if callable(state_dict) else None


def _rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _per_rank(value: Any) -> list[Any]:
    """``value`` of every rank, in rank order (a collective under a process group)."""
    rank, world = _rank_and_world()
    if world == 1:
        return [value]
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, value)
    return gathered


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

