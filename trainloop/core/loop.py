"""The loop of one trainer: the work of each state, the edges' actions, and the policies the conditions name.

``BaseTrainer.train()`` runs it; ``trainloop.machine`` says which state comes next.

The loop owns the run: what it produces (``step``, ``epoch``, ``step_info``, the built
components, ``hooks``, the data iterator) is its ``RunState``, which the trainer shows read-only
to users and hooks; what only sequencing needs (the step runner, the retry count, the requests)
lives here too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from time import perf_counter
from typing import TYPE_CHECKING, Any

from trainloop.checkpoint.weights import init_from
from trainloop.core.compiling import CompileWatch, note_compiled
from trainloop.core.data import EpochIterator
from trainloop.core.metrics import METRICS_FILE
from trainloop.core.result import RefusedRunError
from trainloop.core.rng import rng_kept, seed_all, set_rng_state
from trainloop.core.run_kinds import RunOfKind, Work, restore_weights
from trainloop.core.run_state import SINGLE, RunState
from trainloop.core.step import (
    DeviceVerdict,
    StepPlan,
    StepRunner,
    check_forward,
    trainer_step_plan,
    trainer_update_plans,
)
from trainloop.distributed.agreement import ExitAgreement
from trainloop.distributed.deepspeed import EngineStep, start_engine
from trainloop.distributed.rank_seeds import seed_ranks_apart, warn_if_ranks_drew_the_same
from trainloop.distributed.ranks import is_rank_zero, world_size
from trainloop.hook_machinery.dispatch import ScheduledCalls, call_each, check_hooks, hook_dispatch, state_entry_methods
from trainloop.hook_machinery.registry import build_declared_hooks, with_default_hooks
from trainloop.loss import Loss
from trainloop.machine.runner import StateMachine
from trainloop.machine.table import State
from trainloop.machine.trace import start_run_record, write_settings
from trainloop.settings.optimizer import optimizer_names_problem
from trainloop.step_info import StepInfo

if TYPE_CHECKING:
    import torch

    from trainloop.core.result import RunKind
    from trainloop.core.run_kinds import WeightsSource
    from trainloop.core.run_state import TrainerContract, TrainerView
    from trainloop.predict.run import PredictRun

__all__ = ["Loop", "RunRequests", "raise_if_no_retries_left"]


class Loop:
    """Runs one trainer's machine from ``idle`` to ``exiting``.

    Args:
        trainer: The trainer whose contract (``build_*``, ``forward``) and hooks the loop calls.
    """

    def __init__(self, trainer: TrainerContract) -> None:
        self.trainer = trainer
        self.run_state = RunState(dispatch=hook_dispatch(()))
        self.requests = RunRequests()
        self.retries = 0  # retries of the step in progress
        self.applied = True  # whether the last optimizer update was applied
        self.loss_scale = 0.0  # fp16: GradScaler's scale after the last refused update
        self.runner: StepRunner | EngineStep | None = None  # the update in progress
        self.runners: tuple[StepRunner | EngineStep, ...] = ()  # one per optimizer, in update order
        self.engine: Any = None  # the DeepSpeed engine, when settings.deepspeed is declared
        self._update = 0  # the index of the update in progress in its step
        self._recorded = (0, 0, 0)  # the step's losses, records and items recorded before the update in progress
        self._names: tuple[str, ...] = ()  # the optimizers' names, in update order
        self._named = False  # several optimizers by name: losses and grad norms kept by name
        self._optimizers: tuple[torch.optim.Optimizer, ...] = ()
        self._verdicts: tuple[DeviceVerdict, ...] = ()  # the updates' own (optimizers that skip on the device)
        self.step_start = 0.0
        self._checkpointed = -1  # the step whose work of checkpointing is done (its on_exit callbacks may run)
        self.of_kind = RunOfKind()  # what the run's kind changes: its hooks, its work, its policies, its record
        self.schedules = ScheduledCalls(())
        self.compile_watch = CompileWatch()
        self.machine = StateMachine(
            conditions={
                "should_exit": self.should_exit,
                "predicting_run": lambda: self.of_kind.predicts,
                "microsteps_remain": self.microsteps_remain,
                "updates_remain": self.updates_remain,
                "grads_non_finite": self.grads_non_finite,
                "validation_due": self.validation_due,
                "checkpoint_due": self.checkpoint_due,
            },
            actions={"begin_step": self.begin_step, "next_update": self.next_update, "redo_step": self.redo_step},
            owner=trainer,
            step=lambda: self.run_state.step,
        )

    def run(
        self, kind: RunKind = "train", source: WeightsSource | None = None, predict_run: PredictRun | None = None
    ) -> None:
        """Advance the machine and do each state's work until ``exiting``; see ``train()`` and the other runs.

        Args:
            kind: ``"train"``, ``"evaluate"`` (through ``validating``) or ``"predict"`` (``predict_run``'s work).
            source: Where a run that trains nothing takes the model's weights from.
            predict_run: A predict run's work.
        """
        machine, trainer = self.machine, self.trainer
        self.of_kind = RunOfKind(kind, source, predict_run.work() if predict_run is not None else None)
        training: Work = {
            State.BUILDING: self.build,
            State.RESTORING: self.restore,
            State.ACCUMULATING: self.accumulate,
            State.STEPPING: self.update,
            State.RETRYING: self.retry,
            State.VALIDATING: self.validate,
            State.CHECKPOINTING: self.checkpoint,
        }
        work = self.of_kind.work(training, self.restore_weights)
        # A run that trains nothing records no settings.json and no trace file: the training run's stand.
        machine.trace = start_run_record(trainer.settings, write=self.of_kind.trains)
        try:
            state = machine.advance()
            while state is not State.EXITING:
                work[state]()
                state = machine.advance()
        except BaseException as error:
            self.run_state.error = error
            try:
                machine.fail()  # leaving the state runs its on_exit callbacks: the one that raised may raise again
            except BaseException as again:  # noqa: BLE001 - the run's error is the first; the hooks still end
                self._absorb([again])
            # The error that ended the run is the one train() raises: a hook failing on the
            # way out is logged and noted on it, never raised in its place.
            self._absorb(call_each(self.run_state.dispatch["on_exception"], trainer, error))
            self._absorb(self.exit())
            raise
        errors = self.exit()
        if errors:  # the first is raised; any later ones are logged
            self.run_state.error = errors[0]
            self._absorb(errors[1:])
            raise errors[0]

    # -- the work of each state ----------------------------------------------------------------

    def build(self) -> None:
        """The work of ``building``: the components, the hooks, DeepSpeed's engine if declared, the hooks' dispatch."""
        t, run = self.trainer, self.run_state
        self.build_components()
        hooks = with_default_hooks(build_declared_hooks(t.settings.hooks, t.build_hooks()), t.settings)
        check_hooks(hooks)
        hooks = self.of_kind.taking_part(hooks, type(t).__name__)
        run.hooks = tuple(hooks)
        self.schedules = ScheduledCalls(hooks)
        if t.settings.deepspeed is not None:
            self.start_engine()
        run.dispatch = hook_dispatch(hooks, self.schedules)
        for hook in hooks:
            for state, method in state_entry_methods(hook):
                self.machine.on_enter(state, method)

    def build_components(self, lr_scheduler: bool = True) -> None:
        """Seed, then build data loader, model, optimizer, lr scheduler and grad scaler, in that order.

        Each may read the ones before it: ``building`` starts with these, and ``lr_find`` builds them without the lr
        scheduler (``lr_scheduler=False``).
        """
        t, built = self.trainer, self.run_state.built
        if t.settings.seed is not None:
            seed_all(t.settings.seed)
        built["data_loader"] = t.build_data_loader()
        t.run_length.plan(built["data_loader"])
        built["model"] = t.build_model()
        if t.settings.seed_per_rank:  # validated: seed is set
            seed_ranks_apart(t.settings.seed)  # type: ignore[arg-type]
        built["optimizer"] = optimizers = t.build_optimizer()
        if isinstance(optimizers, Mapping):  # named as declared ones must be: the same check
            problem = optimizer_names_problem(list(optimizers))
            if problem is not None:
                returned = f"optimizers {', '.join(map(repr, optimizers))}" if optimizers else "an empty mapping"
                raise RefusedRunError(f"{type(t).__name__}.build_optimizer() returned {returned}: {problem}")
        named = list(self.run_state.optimizers) if self.run_state.named_optimizers else None
        check_forward(t.forward, f"{type(t).__name__}.forward()", named)
        if lr_scheduler:
            built["lr_scheduler"] = t.build_lr_scheduler()
        built["grad_scaler"] = t.build_grad_scaler()

    def start_engine(self) -> None:
        """Hand the built model, optimizer and lr scheduler to DeepSpeed; its engine is the model from here on."""
        t, built = self.trainer, self.run_state.built
        built["model"] = self.engine = start_engine(
            t.settings, type(t).__name__, built["model"], built["optimizer"], built.get("lr_scheduler"),
            built["data_loader"],
        )

    @contextlib.contextmanager
    def components_kept(self) -> Iterator[None]:
        """Give the built components back what they held (or their absence) afterwards.

        For a tool that builds and runs a trainer's step outside ``train()`` (``lr_find``).
        """
        saved = dict(self.run_state.built)
        try:
            yield
        finally:
            self.run_state.built.clear()
            self.run_state.built.update(saved)

    def restore(self) -> None:
        """The work of ``restoring``: restore what the restoring callbacks loaded."""
        # A checkpoint, if any, was loaded by on_enter_restoring callbacks before this runs.
        t, run = self.trainer, self.run_state
        write_settings(t.settings)  # only now: a run refused while restoring leaves the last run's
        if t.settings.metrics_file and t.settings.workspace is not None and is_rank_zero():
            t.metrics.open(t.settings.workspace / METRICS_FILE, resumed_step=run.step)
        init_from(t)  # a fine-tune's weights, unless a checkpoint of the run was resumed
        for fn in run.dispatch["on_before_train"]:
            fn(t)
        epochs = t.settings.max_epochs
        run.data = EpochIterator(
            run.built["data_loader"], run.epoch, resumed=run.step > 0, limit=epochs, position=run.restored_position
        )
        t.run_length.follow(run.data)
        if world_size() > 1:  # one small all-gather, at the first batch only
            run.data.tap_first_batch(warn_if_ranks_drew_the_same)
        if run.restored_rng is not None:
            # Only now: resuming mid-epoch makes the epoch's iterator again from the generators as the
            # epoch began (its base seed, its order), which the uninterrupted run did long before this step.
            set_rng_state(run.restored_rng)
            run.restored_rng = None
        # With max_epochs, steps end with epochs: each declared batch is drawn once.
        self.build_runners(run.data, epochs=run.data if epochs else None)
        self.requests.open()
        t.model.train()
        self.zero_grads()

    def restore_weights(self) -> None:
        """The work of ``restoring`` in a run that trains nothing: the model's weights, then the validations' checks."""
        t, run = self.trainer, self.run_state
        found = restore_weights(t, self.of_kind.built_hooks, self.of_kind.source)
        run.step = found.step if found is not None and found.step is not None else 0
        run.epoch = found.epoch if found is not None and found.epoch is not None else 0
        if found is None:
            init_from(t)  # the model as built: a fine-tune's starting weights, if declared
        for fn in run.dispatch["on_before_train"]:
            fn(t)
        self.requests.open()  # the validations may request (an exit); the ranks agree as in training
        if self.of_kind.evaluates:
            self.schedules.queue_all("validating", run.step)

    def build_runners(self, data: Iterator[Any], epochs: EpochIterator | None) -> None:
        """One step runner per optimizer, in update order; with several, a step's batches kept for every update."""
        run = self.run_state
        self._named = run.named_optimizers
        self._optimizers = tuple(run.optimizers.values())
        if self.engine is not None:
            self.runners = (EngineStep(self.engine, self.step_plan(), data, epochs=epochs),)
            self._names = (SINGLE,)
        elif self._named:
            hooks = self.before_optimizer_step if run.dispatch["on_before_optimizer_step"] else None
            plans = trainer_update_plans(
                self.trainer, check_grads=self.trainer.settings.detect_non_finite_grads, before_optimizer_step=hooks
            )
            kept: list[Any] = []
            self.runners = tuple(StepRunner(plan, data, epochs=epochs, kept=kept) for plan in plans.values())
            self._names = tuple(plans)
        else:
            self.runners = (StepRunner(self.step_plan(), data, epochs=epochs),)
            self._names = (SINGLE,)
        self.runner = self.runners[0]
        verdicts = {name: r.verdict for name, r in zip(self._names, self.runners, strict=True) if r.verdict is not None}
        run.verdicts = dict(verdicts)
        self._verdicts = tuple(verdicts.values())
        restored, run.restored_verdicts = run.restored_verdicts or {}, None
        for name, verdict in verdicts.items():
            if name in restored:  # the resumed run decides as the unbroken one would have
                verdict.load_state_dict(restored[name])

    def zero_grads(self) -> None:
        """Zero the gradients of every optimizer's parameters."""
        for optimizer in self._optimizers:
            optimizer.zero_grad()

    def step_plan(self) -> StepPlan:
        """Everything the hot loop would otherwise look up per microstep, resolved once."""
        t = self.trainer
        return trainer_step_plan(
            t,
            lr_scheduler=t.lr_scheduler,
            check_grads=t.settings.detect_non_finite_grads,
            before_optimizer_step=self.before_optimizer_step
            if self.run_state.dispatch["on_before_optimizer_step"]
            else None,
        )

    def before_optimizer_step(self) -> None:
        """Run the hooks' ``on_before_optimizer_step``."""
        for fn in self.run_state.dispatch["on_before_optimizer_step"]:
            fn(self.trainer)

    def accumulate(self) -> None:
        """The work of ``accumulating``: one microstep (forward and backward)."""
        loss, records, data_time = self.runner.microstep()  # type: ignore[union-attr]
        info = self.run_state.step_info
        info.data_time.append(data_time)
        if loss is None:  # the epoch ran out while forward skipped batches: the step ends
            return
        info.records.append(records)
        if isinstance(loss, Loss):
            info.items.append(loss.count)
            value = loss.sum.detach() / loss.count
        else:
            value = loss.detach()
        info.loss.append(value)
        if self._named:
            info.losses.setdefault(self.run_state.updating, []).append(value)

    def update(self) -> None:
        """The work of ``stepping``: the optimizer update, then the step's bookkeeping.

        Where the optimizer skips non-finite updates on the device, the verdict of the previous
        step's update is read first (from host memory: no wait), and this step's own before the
        run validates, saves or ends after it.
        """
        t, run, runner = self.trainer, self.run_state, self.runner
        assert runner is not None
        verdict = runner.verdict
        if verdict is not None and verdict.pending:  # the last step's: nothing retries after it
            self.learn_verdict(run.step - 1, verdict)
        self.applied = runner.update()
        if t.settings.grad_clip is not None:
            run.step_info.grad_norm = runner.grad_norm
            if self._named:
                run.step_info.grad_norms[run.updating] = runner.grad_norm  # type: ignore[assignment]  # set: clipping
        if not self.applied:
            self.loss_scale = raise_if_no_retries_left(t, self.retries)
            return
        if self._update + 1 < len(self.runners):
            return  # the step's next update follows (next_update): the step's bookkeeping waits for its last
        run.step_info.step_time = step_time = perf_counter() - self.step_start
        compiled = self.compile_watch.end(run.step, step_time)
        if compiled is not None:
            note_compiled(compiled, run.step_info, self.machine.trace, t.logger)
        for fn in run.dispatch["on_after_step"]:
            fn(t)
        self.settle()
        verdicts = self._verdicts
        if verdicts and any(v.pending for v in verdicts):
            self.learn_before_leaving(run.step)

    def learn_before_leaving(self, step: int) -> None:
        """Read this step's verdicts now if the run validates, saves or ends after it: never on an unread one."""
        if self.validation_due() or self.checkpoint_due() or self.should_exit():
            for verdict in self._verdicts:
                if verdict.pending:
                    self.learn_verdict(step, verdict)

    def learn_verdict(self, step: int, verdict: DeviceVerdict) -> None:
        """Read whether an update of ``step`` was skipped on the device; report a skip, or raise past the limit."""
        t = self.trainer
        skipped, scale = verdict.read()
        if not skipped:
            return
        in_a_row = verdict.skipped_in_a_row
        self.run_state.step_info.skipped_update = step
        if self.machine.trace is not None:
            self.machine.trace.mark_skipped(step)
        raise_if_no_retries_left(t, in_a_row - 1, skipped=step, scale=scale)
        if t.grad_scaler.is_enabled():  # expected now and then under fp16: not a warning
            t.logger.info(
                "fp16 update of step %d skipped (non-finite gradients); loss scale now %g (%d in a row)",
                step, scale, in_a_row,
            )
        else:
            t.logger.warning(
                "Non-finite gradients at step %d: its update was skipped (%d in a row, at most %d)",
                step, in_a_row, t.settings.max_non_finite_grad_retries,
            )

    def settle(self) -> None:
        """Settle the requests; when the ranks first agree to exit, queue what the end of the run is due."""
        agreed = self.requests.exit_agreed
        self.requests.settle()
        if self.requests.exit_agreed and not agreed and self.of_kind.trains:
            self.schedules.exit_agreed(self.trainer)

    def validate(self) -> None:
        """The work of ``validating``: every validation due, in hook order; then their requests (an exit).

        The random generators get their states back afterwards: what a validation draws (its loader's base seed, a
        sampled evaluation) stays off the training's stream, so a run that validates at other points (at its start,
        again on resume, or not after an exit signal) trains on the same draws.
        """
        with rng_kept():
            while self.schedules.due["validating"]:
                self.schedules.run_due("validating", self.trainer)
                self.settle()  # early stopping on the fresh metric ends the run now, not a step later
        self.of_kind.pass_done()

    def retry(self) -> None:
        """The work of ``retrying``: drop the update whose gradients were not finite, and what its try recorded."""
        t = self.trainer
        self.retries += 1
        if t.grad_scaler.is_enabled():  # expected at the start of fp16 runs: not a warning
            t.logger.info(
                "fp16 update refused at step %d (non-finite gradients); loss scale now %g; retrying (%d)",
                t.step, self.loss_scale, self.retries,
            )
        else:
            t.logger.warning(
                "Non-finite gradients at step %d; retrying (%d/%d)",
                t.step, self.retries, t.settings.max_non_finite_grad_retries,
            )
        self.zero_grads()
        # The refused try's records go; those of the step's updates applied before it stay.
        info, (losses, records, items) = self.run_state.step_info, self._recorded
        del info.loss[losses:], info.records[records:], info.items[items:]
        info.losses.pop(self.run_state.updating, None)
        info.grad_norms.pop(self.run_state.updating, None)
        info.non_finite_grad_retries = self.retries

    def checkpoint(self) -> None:
        """The work of ``checkpointing``: the saves due, in hook order (a requested save: every saving hook's).

        A request made here (an ``on_enter_checkpointing`` callback, a hook's ``on_schedule``) is met by the
        saves of this step: every saving hook that has not saved it yet saves it, none twice, and the next
        step owes nothing.
        """
        step = self.run_state.step
        while True:
            if self.requests.take_checkpoint():
                self.requested_save(step)
            if not self.schedules.due["checkpointing"]:
                break
            self.schedules.run_due("checkpointing", self.trainer)
        self._checkpointed = step

    def requested_save(self, step: int) -> None:
        """Queue the save a request asks for at ``step``: every saving hook's that has not saved it; say if none can."""
        if self.of_kind.trains and (
            self.schedules.acts_in("checkpointing") or self.machine.listens(State.CHECKPOINTING)
        ):
            self.schedules.queue_all("checkpointing", step)
            return
        if not is_rank_zero():  # every rank makes the request alike: rank 0 says it once
            return
        why = "this run" if self.of_kind.trains else f"an {self.of_kind.kind} run"
        self.trainer.logger.warning(
            "A checkpoint was requested at step %d, but no hook of %s saves one%s",
            step, why, " (add a CheckpointingHook)" if self.of_kind.trains else "",
        )

    def request_checkpoint(self) -> None:
        """A save at the end of this step (``trainer.request_checkpoint()``).

        Made in ``checkpointing`` once its saves are done (an ``on_exit`` callback), it is met by them.
        """
        if self.machine.state is State.CHECKPOINTING and self._checkpointed == self.run_state.step:
            return
        self.requests.request_checkpoint()

    def exit(self) -> list[BaseException]:
        """Every hook's ``on_after_train``, then close what the run opened.

        One hook that fails does not stop the others: each may have something to give back, such as signal handlers.

        Returns:
            What the hooks raised, in hook order (the first is what a clean run raises).
        """
        t, run = self.trainer, self.run_state
        if self.machine.trace is not None:
            self.machine.trace.close()
        try:
            errors = call_each(run.dispatch["on_after_train"], t)
            self.unmet_request()
            return errors
        finally:
            t.metrics.close()
            # After an error, the other ranks may not get here: no last collective then.
            self.requests.close(clean=self.run_state.error is None)
            if run.data is not None:
                run.data.close()
                run.epoch = run.data.epoch

    def unmet_request(self) -> None:
        """Say a save requested where none can follow (as the run ends, in ``exiting``), unless the last step was saved.

        After an error nothing is said: the error is what the run ended with.
        """
        if not self.requests.take_checkpoint() or self.run_state.error is not None:
            return
        step = self.run_state.step
        if not self.of_kind.trains or not self.schedules.acts_in("checkpointing"):
            self.requested_save(step)  # says that no hook saves
        elif not self.schedules.acted_at("checkpointing", step) and is_rank_zero():
            self.trainer.logger.warning(
                "A checkpoint was requested at step %d as the run ended, after its last save: no save follows a "
                "request made in exiting (request it in on_after_step)",
                step,
            )

    def _absorb(self, errors: list[BaseException]) -> None:
        """Log hooks' errors raised while the run ends by another error, and note them on it."""
        ended_by = self.trainer.error
        for error in errors:
            if error is ended_by:  # a hook re-raising the run's own error adds nothing
                continue
            self.trainer.logger.error(
                "A hook raised %r while the run was ending by %r", error, ended_by, exc_info=error
            )
            if ended_by is not None:
                ended_by.add_note(f"While the run was ending, a hook raised {type(error).__name__}: {error}")

    # -- the edges' actions --------------------------------------------------------------------

    def begin_step(self) -> None:
        """``begin_step``: a new step, counted, announced to ``on_before_step``."""
        run = self.run_state
        run.step += 1
        self.retries = 0
        run.step_info = StepInfo()
        self.step_start = perf_counter()
        self.compile_watch.begin()
        self._recorded = (0, 0, 0)
        if self._named:  # another update's backward left gradients on this one's parameters
            self._update = 0
            self.runner = self.runners[0]
            run.updating = self._names[0]
            self.zero_grads()
        self.runner.begin()  # type: ignore[union-attr]
        for fn in run.dispatch["on_before_step"]:
            fn(self.trainer)

    def next_update(self) -> None:
        """``next_update``: the next optimizer's update of the step, on the step's batches, from zero gradients."""
        index = self._update = self._update + 1
        info = self.run_state.step_info
        self._recorded = (len(info.loss), len(info.records), len(info.items))
        self.runner = self.runners[index]
        self.run_state.updating = self._names[index]
        self.zero_grads()
        self.runner.begin(fresh=False)

    def redo_step(self) -> None:
        """``redo_step``: the refused update again, on fresh batches; the step neither counted nor announced."""
        self.runner.begin()  # type: ignore[union-attr]

    # -- the policies --------------------------------------------------------------------------

    def should_exit(self) -> bool:
        """Whether the run ends: an agreed exit request, or the run length reached; a run that trains nothing: done."""
        if not self.of_kind.trains:
            return self.of_kind.done
        return self.requests.exit_agreed or self.trainer.run_length.reached(self.run_state.step)

    def microsteps_remain(self) -> bool:
        """Whether the step in progress needs another microstep."""
        return self.runner.microsteps_remain()  # type: ignore[union-attr]

    def updates_remain(self) -> bool:
        """Whether another optimizer's update of the step follows (several optimizers)."""
        return self._update + 1 < len(self.runners)

    def grads_non_finite(self) -> bool:
        """Whether the last update found non-finite gradients and was skipped."""
        return not self.applied

    def validation_due(self) -> bool:
        """Whether a validation is due now (queued by its schedule, or by an evaluate run)."""
        return bool(self.schedules.due["validating"])

    def checkpoint_due(self) -> bool:
        """Whether a save is due now: a hook's schedule, or a request."""
        return bool(self.schedules.due["checkpointing"]) or self.requests.checkpoint_requested


class RunRequests:
    """What hooks and users ask of a run, settled at the end of a step: a save, an exit.

    Attributes:
        exit_agreed: Whether the run ends after this step (on every rank, once they agreed).
        exit_code: The exit code agreed on with an exit request, or ``None``.
        checkpoint_requested: Whether a save was asked for at the end of this step.
    """

    def __init__(self) -> None:
        self.exit_agreed = False
        self.exit_code: int | None = None
        self.checkpoint_requested = False
        self._exit = 0  # this rank's: 0 none, else 1 + exit code
        self._agreement: ExitAgreement | None = None

    def request_checkpoint(self) -> None:
        """A save at the end of this step."""
        self.checkpoint_requested = True

    def take_checkpoint(self) -> bool:
        """Whether a save was requested; the request is met from here on."""
        requested, self.checkpoint_requested = self.checkpoint_requested, False
        return requested

    def request_exit(self, exit_code: int | None = None) -> None:
        """End the run after this step (with ``exit_code``, if given; the highest asked wins)."""
        self._exit = max(self._exit, 1 + (exit_code or 0))

    def open(self) -> None:
        """Start agreeing on exit requests across ranks (a collective under a process group)."""
        self._agreement = ExitAgreement()

    def settle(self) -> None:
        """At the end of an applied update: submit this rank's exit request, read the agreement."""
        agreed = self._agreement.settle(self._exit)  # type: ignore[union-attr]
        if agreed:
            self.exit_agreed = True
            if agreed > 1:
                self.exit_code = agreed - 1

    @property
    def in_flight(self) -> bool:
        """Whether the exit agreement has a collective pending, or its tensor still with the backend."""
        return self._agreement is not None and self._agreement.in_flight

    def close(self, clean: bool = True) -> None:
        """Wait for the agreement in flight; at a ``clean`` end, for the backend to let go too (``ExitAgreement``)."""
        if self._agreement is not None:
            self._agreement.close(drain=clean)


def raise_if_no_retries_left(
    trainer: TrainerView, retries: int, *, skipped: int | None = None, scale: float | None = None
) -> float:
    """Raise unless the step may be tried again after ``retries`` retries; return the loss scale.

    Without a grad scaler, ``settings.max_non_finite_grad_retries`` counts the tries. Under fp16,
    GradScaler refuses updates while it finds its scale, so a floor on the scale
    (``settings.min_loss_scale``), not a count, tells that from gradients non-finite at any scale
    (fairseq's and DeepSpeed's ``min_loss_scale``); a declared count bounds it too.

    An update skipped on the device is bounded the same way, a step late: ``skipped`` is its
    step, ``retries`` the updates skipped just before it, ``scale`` the loss scale read with it.

    Returns:
        Under fp16, GradScaler's scale now (read from the scaler, one more host sync, unless
        given); else 0.

    Raises:
        RuntimeError: No retry is left; the message says which bound was met.
    """
    t = trainer
    declared = t.settings.max_non_finite_grad_retries
    fp16 = t.grad_scaler.is_enabled()
    if not fp16:
        scale = 0.0
    elif scale is None:
        scale = t.grad_scaler.get_scale()
    if skipped is None:
        at, tries = f"at step {t.step}", f"{retries} retries"
    else:
        stopped = f"; the run stopped at step {t.step}" if t.step != skipped else ""
        at = f"at step {skipped} (its update skipped on the device{stopped})"
        tries = f"{retries + 1} skipped updates in a row"
    if fp16:
        floor = t.settings.min_loss_scale
        if scale < floor:
            raise RuntimeError(
                f"non-finite gradients {at} after {tries}: under fp16 "
                f"the loss scale fell to {scale:g}, below min_loss_scale={floor:g}, so the "
                "gradients are non-finite at any scale (a NaN or inf in the loss or the model?)"
            )
        if declared is None or retries < declared:
            return scale
    elif retries < (declared or 0):
        return scale
    if not declared:
        what = "the step is not retried" if skipped is None else "no update may be skipped"
        raise RuntimeError(f"non-finite gradients {at}; max_non_finite_grad_retries is {declared}, so {what}")
    note = f"; the loss scale is now {scale:g}" if fp16 else ""
    raise RuntimeError(f"non-finite gradients {at} after {tries} (max_non_finite_grad_retries={declared}){note}")
