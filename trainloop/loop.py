"""The loop of one trainer: the work of each state, the edges' actions, and the policies the
transition table's conditions name. ``BaseTrainer.train()`` runs it; ``trainloop.machine`` says
which state comes next.

What the run produces (``step``, ``epoch``, ``step_info``, the built components, ``hooks``)
lives on the trainer, where users and hooks read it; what only sequencing needs (the step
runner, the retry count, the requests) lives here.
"""

from __future__ import annotations

from collections.abc import Callable
from time import perf_counter
from typing import TYPE_CHECKING, Any

import torch

from trainloop.checkpoint.weights import init_from
from trainloop.data import EpochIterator
from trainloop.distributed.rank_seeds import warn_if_ranks_drew_the_same
from trainloop.distributed.ranks import is_rank_zero, world_size
from trainloop.hooks.dispatch import check_hooks, hook_dispatch, state_entry_methods
from trainloop.hooks.registry import build_declared_hooks
from trainloop.loss import Loss
from trainloop.machine.runner import StateMachine
from trainloop.machine.table import State
from trainloop.machine.trace import start_run_record
from trainloop.metrics import METRICS_FILE
from trainloop.requests import RunRequests
from trainloop.rng import set_rng_state
from trainloop.step import StepInfo, StepPlan, StepRunner

if TYPE_CHECKING:
    from trainloop.trainer import BaseTrainer

__all__ = ["Loop", "trainer_step_plan"]


class Loop:
    """Runs one trainer's machine from ``idle`` to ``exiting``.

    Args:
        trainer: The trainer whose contract (``build_*``, ``forward``) and hooks the loop calls.
    """

    def __init__(self, trainer: BaseTrainer) -> None:
        self.trainer = trainer
        self.requests = RunRequests()
        self.retries = 0  # retries of the step in progress
        self.applied = True  # whether the last optimizer update was applied
        self.data: EpochIterator | None = None
        self.runner: StepRunner | None = None
        self.restored_rng: dict[str, Any] | None = None  # set by a checkpoint load in restoring
        self.restored_position: dict[str, Any] | None = None  # a plain DataLoader's, likewise
        self.step_start = 0.0
        self.machine = StateMachine(
            conditions={
                "should_exit": self.should_exit,
                "microsteps_remain": self.microsteps_remain,
                "grads_non_finite": self.grads_non_finite,
                "checkpoint_due": self.checkpoint_due,
            },
            actions={"begin_step": self.begin_step, "redo_step": self.redo_step},
            owner=trainer,
            step=lambda: trainer.step,
        )

    def run(self) -> None:
        """Advance the machine and do each state's work until ``exiting``; see ``train()``."""
        machine, trainer = self.machine, self.trainer
        work: dict[State, Callable[[], None]] = {
            State.BUILDING: self.build,
            State.RESTORING: self.restore,
            State.ACCUMULATING: self.accumulate,
            State.STEPPING: self.update,
            State.RETRYING: self.retry,
            State.CHECKPOINTING: self.checkpoint,
        }
        machine.trace = start_run_record(trainer.settings)
        try:
            state = machine.advance()
            while state is not State.EXITING:
                work[state]()
                state = machine.advance()
        except BaseException as error:
            trainer.error = error
            machine.fail()
            try:
                for fn in trainer._dispatch["on_exception"]:
                    fn(trainer, error)
            finally:
                self.exit()
            raise
        self.exit()

    # -- the work of each state ----------------------------------------------------------------

    def build(self) -> None:
        t = self.trainer
        t._build_components()
        t.lr_scheduler = t.build_lr_scheduler()
        t.grad_scaler = t.build_grad_scaler()
        t.hooks = build_declared_hooks(t.settings.hooks, t.build_hooks())
        check_hooks(t.hooks)
        t._dispatch = hook_dispatch(t.hooks)
        for hook in t.hooks:
            for state, method in state_entry_methods(hook):
                self.machine.on_enter(state, method)

    def restore(self) -> None:
        # A checkpoint, if any, was loaded by on_enter_restoring callbacks before this runs.
        t = self.trainer
        if t.settings.metrics_file and t.settings.workspace is not None and is_rank_zero():
            t.metrics.open(t.settings.workspace / METRICS_FILE, resumed_step=t.step)
        init_from(t)  # a fine-tune's weights, unless a checkpoint of the run was resumed
        for fn in t._dispatch["on_before_train"]:
            fn(t)
        self.data = EpochIterator(t.data_loader, t.epoch, resumed=t.step > 0, position=self.restored_position)
        t.run_length.follow(self.data)
        if world_size() > 1:  # one small all-gather, at the first batch only
            self.data.tap_first_batch(warn_if_ranks_drew_the_same)
        if self.restored_rng is not None:
            # Only now: creating the data iterator draws from torch's generator (its base seed),
            # which the uninterrupted run did long before this step.
            set_rng_state(self.restored_rng)
            self.restored_rng = None
        self.runner = StepRunner(self.step_plan(), self.data)
        self.requests.open()
        t.model.train()
        t.optimizer.zero_grad()

    def step_plan(self) -> StepPlan:
        """Everything the hot loop would otherwise look up per microstep, resolved once."""
        t = self.trainer
        return trainer_step_plan(
            t,
            lr_scheduler=t.lr_scheduler,
            check_grads=t.settings.detect_non_finite_grads,
            before_optimizer_step=self.before_optimizer_step if t._dispatch["on_before_optimizer_step"] else None,
        )

    def before_optimizer_step(self) -> None:
        for fn in self.trainer._dispatch["on_before_optimizer_step"]:
            fn(self.trainer)

    def accumulate(self) -> None:
        loss, records, data_time = self.runner.microstep()  # type: ignore[union-attr]
        info = self.trainer.step_info
        info.data_time.append(data_time)
        info.records.append(records)
        info.loss.append(loss.sum.detach() / loss.count if isinstance(loss, Loss) else loss.detach())

    def update(self) -> None:
        t, runner = self.trainer, self.runner
        self.applied = runner.update()  # type: ignore[union-attr]
        if t.settings.grad_clip is not None:
            t.step_info.grad_norm = runner.grad_norm  # type: ignore[union-attr]
        if not self.applied:
            self._raise_if_no_retries_left()
            return
        t.step_info.step_time = perf_counter() - self.step_start
        for fn in t._dispatch["on_after_step"]:
            fn(t)
        self.requests.settle()

    def _raise_if_no_retries_left(self) -> None:
        t = self.trainer
        declared = t.settings.max_non_finite_grad_retries
        if self.retries < (declared or 0):
            return
        scale = (
            f"; the grad scaler's scale is now {t.grad_scaler.get_scale():g} (raise "
            "max_non_finite_grad_retries to let it settle lower)"
            if t.grad_scaler.is_enabled() else ""
        )
        if not declared:
            raise RuntimeError(
                f"non-finite gradients at step {t.step}; max_non_finite_grad_retries is "
                f"{declared}, so the step is not retried{scale}"
            )
        raise RuntimeError(
            f"non-finite gradients at step {t.step} after {self.retries} retries "
            f"(max_non_finite_grad_retries={declared}){scale}"
        )

    def retry(self) -> None:
        t = self.trainer
        self.retries += 1
        t.logger.warning(
            "Non-finite gradients at step %d; retrying (%d/%d)",
            t.step, self.retries, t.settings.max_non_finite_grad_retries,
        )
        t.optimizer.zero_grad()
        info = t.step_info
        info.loss, info.records = [], []
        info.non_finite_grad_retries = self.retries

    def checkpoint(self) -> None:
        # The save itself is done by on_enter_checkpointing callbacks (CheckpointingHook).
        self.requests.checkpointed(self.trainer.step)

    def exit(self) -> None:
        t = self.trainer
        if self.machine.trace is not None:
            self.machine.trace.close()
        try:
            for fn in t._dispatch["on_after_train"]:
                fn(t)
        finally:
            t.metrics.close()
            self.requests.close()
            if self.data is not None:
                self.data.close()
                t.epoch = self.data.epoch

    # -- the edges' actions --------------------------------------------------------------------

    def begin_step(self) -> None:
        """``begin_step``: a new step, counted, announced to ``on_before_step``."""
        t = self.trainer
        t.step += 1
        self.retries = 0
        t.step_info = StepInfo()
        self.step_start = perf_counter()
        self.runner.begin()  # type: ignore[union-attr]
        for fn in t._dispatch["on_before_step"]:
            fn(t)

    def redo_step(self) -> None:
        """``redo_step``: the same step again, on fresh batches; neither counted nor announced."""
        self.runner.begin()  # type: ignore[union-attr]

    # -- the policies --------------------------------------------------------------------------

    def should_exit(self) -> bool:
        return self.requests.exit_agreed or self.trainer.run_length.reached(self.trainer.step)

    def microsteps_remain(self) -> bool:
        return self.runner.microsteps < self.trainer.settings.gradient_accumulation_steps  # type: ignore[union-attr]

    def grads_non_finite(self) -> bool:
        return not self.applied

    def checkpoint_due(self) -> bool:
        return self.requests.checkpoint_due(self.trainer.step, ending=self.should_exit)


def trainer_step_plan(
    trainer: BaseTrainer,
    *,
    check_grads: bool,
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    before_optimizer_step: Callable[[], None] | None = None,
) -> StepPlan:
    """The step of ``trainer``'s built components under its settings (``lr_find`` runs it too)."""
    settings = trainer.settings
    return StepPlan(
        model=trainer.model,
        optimizer=trainer.optimizer,
        forward=trainer.forward,
        owner=f"{type(trainer).__name__}.forward()",
        accumulation=settings.gradient_accumulation_steps,
        grad_clip=settings.grad_clip,
        grad_scaler=trainer.grad_scaler,
        lr_scheduler=lr_scheduler,
        check_grads=check_grads,
        no_sync=settings.no_sync_accumulate,
        autocast=trainer.autocast(),  # reused: an autocast object can be entered again
        before_optimizer_step=before_optimizer_step,
    )
