"""The loop of one trainer: the work of each state, the edges' actions, and the policies the conditions name.

``BaseTrainer.train()`` runs it; ``trainloop.machine`` says which state comes next.

The loop owns the run: what it produces (``step``, ``epoch``, ``step_info``, the built
components, ``hooks``, the data iterator) is its ``RunState``, which the trainer shows read-only
to users and hooks; what only sequencing needs (the requests, the schedules) lives here too. One
training step lives in its ``Step`` (``trainloop.core.step``), made in ``restoring``: the work of
``accumulating``, ``stepping`` and ``retrying`` and the edges' actions hand over to it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from trainloop.core.compiling import CompileWatch, note_compiled
from trainloop.core.data import EpochIterator
from trainloop.core.deepspeed import engine_runners, launch_problem, one_optimizer, start_engine
from trainloop.core.metrics import METRICS_FILE
from trainloop.core.rank_seeds import seed_ranks_apart, warn_if_ranks_drew_the_same
from trainloop.core.result import RefusedHooksError, RefusedRunError
from trainloop.core.rng import rng_kept, seed_all, set_rng_state
from trainloop.core.run_kinds import RunOfKind, Work, init_from, restore_weights
from trainloop.core.run_state import RunState
from trainloop.core.step import Step, UpdateRunner, check_forward, step_runners
from trainloop.core.workspace import write_settings
from trainloop.distributed.agreement import ExitAgreement
from trainloop.distributed.ranks import is_rank_zero, world_size
from trainloop.hook_machinery.dispatch import (
    ScheduledCalls,
    call_each,
    hook_dispatch,
    hook_problems,
    state_entry_methods,
)
from trainloop.hook_machinery.registry import build_declared_hooks, with_default_hooks
from trainloop.machine.runner import StateMachine
from trainloop.machine.table import State
from trainloop.machine.trace import start_run_record
from trainloop.settings.optimizer import optimizer_names_problem

if TYPE_CHECKING:
    from trainloop.core.result import RunKind
    from trainloop.core.run_kinds import WeightsSource
    from trainloop.core.run_state import TrainerContract

__all__ = ["Loop", "RunRequests"]


class Loop:
    """Runs one trainer's machine from ``idle`` to ``exiting``.

    Args:
        trainer: The trainer whose contract (``build_*``, ``forward``) and hooks the loop calls.

    Attributes:
        step: The run's training step (``Step``), made in ``restoring``.
    """

    step: Step

    def __init__(self, trainer: TrainerContract) -> None:
        self.trainer = trainer
        self.run_state = RunState(dispatch=hook_dispatch(()))
        self.requests = RunRequests()
        self.engine: Any = None  # the DeepSpeed engine, when settings.deepspeed is declared
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
        self, kind: RunKind = "train", source: WeightsSource | None = None, predict_work: Work | None = None
    ) -> None:
        """Advance the machine and do each state's work until ``exiting``; see ``train()`` and the other runs.

        Args:
            kind: ``"train"``, ``"evaluate"`` (through ``validating``) or ``"predict"`` (``predict_work``).
            source: Where a run that trains nothing takes the model's weights from.
            predict_work: A predict run's work per state.
        """
        machine, trainer = self.machine, self.trainer
        self.of_kind = RunOfKind(kind, source, predict_work)
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
        settings = trainer.settings
        machine.trace = start_run_record(settings.trace, settings.workspace if self.of_kind.trains else None)
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
        problems = hook_problems(hooks)
        if problems:
            raise RefusedHooksError("\n".join(problems))
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
        if t.settings.deepspeed is not None:  # before the data loader, which may ask for the process group
            unlaunched = launch_problem()
            if unlaunched is not None:
                raise RefusedRunError(unlaunched)
        if t.settings.seed is not None:
            seed_all(t.settings.seed)
        built["data_loader"] = t.build_data_loader()
        t.run_length.plan(built["data_loader"])
        built["model"] = t.build_model()
        if t.settings.seed_per_rank:  # validated: seed is set
            seed_ranks_apart(t.settings.seed)  # type: ignore[arg-type]
        built["optimizer"] = optimizers = t.build_optimizer()
        if isinstance(optimizers, (list, tuple)):
            raise RefusedRunError(
                f"{type(t).__name__}.build_optimizer() returned a {type(optimizers).__name__} of {len(optimizers)}: "
                "return one optimizer, or a mapping of names to optimizers (docs/optimizers.md)"
            )
        if t.settings.deepspeed is not None:  # its refusal of several before anything about them
            one_optimizer(optimizers, type(t).__name__)
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
            built["data_loader"], self.run_state.hooks,
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
        by_name, ends_with_epochs = run.named_optimizers, run.data if epochs else None
        runners: Mapping[str, UpdateRunner]
        if self.engine is not None:  # the engine runs the one optimizer's update
            runners = engine_runners(self.engine, t, run.data, epochs=ends_with_epochs)
        else:
            runners = step_runners(t, run.data, epochs=ends_with_epochs, by_name=by_name)
        self.step = Step(t, run, runners, by_name=by_name, trace=self.machine.trace)
        self.requests.open()
        t.model.train()
        self.step.zero_grads()

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

    def accumulate(self) -> None:
        """The work of ``accumulating``: one microstep (forward and backward)."""
        self.step.microstep()

    def update(self) -> None:
        """The work of ``stepping``: the step's update; after its last, the hooks' ``on_after_step`` and the requests.

        Where an optimizer skips non-finite updates on the device, this step's verdicts are read before the run
        validates, saves or ends after it.
        """
        step, run, t = self.step, self.run_state, self.trainer
        if not step.update():
            return
        compiled = self.compile_watch.end(run.step, step.seconds)
        if compiled is not None:
            note_compiled(compiled, run.step_info, self.machine.trace, t.logger)
        for fn in run.dispatch["on_after_step"]:
            fn(t)
        self.settle()
        verdicts = step.verdicts
        if verdicts and any(v.pending for v in verdicts) and (
            self.validation_due() or self.checkpoint_due() or self.should_exit()
        ):
            step.read_verdicts()

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
        self.step.retry()

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
        self.run_state.step += 1
        self.compile_watch.begin()
        self.step.begin()

    def next_update(self) -> None:
        """``next_update``: the next optimizer's update of the step, on the step's batches, from zero gradients."""
        self.step.next_update()

    def redo_step(self) -> None:
        """``redo_step``: the refused update again, on fresh batches; the step neither counted nor announced."""
        self.step.redo()

    # -- the policies --------------------------------------------------------------------------

    def should_exit(self) -> bool:
        """Whether the run ends: an agreed exit request, or the run length reached; a run that trains nothing: done."""
        if not self.of_kind.trains:
            return self.of_kind.done
        return self.requests.exit_agreed or self.trainer.run_length.reached(self.run_state.step)

    def microsteps_remain(self) -> bool:
        """Whether the step in progress needs another microstep."""
        return self.step.microsteps_remain()

    def updates_remain(self) -> bool:
        """Whether another optimizer's update of the step follows (several optimizers)."""
        return self.step.updates_remain()

    def grads_non_finite(self) -> bool:
        """Whether the last update found non-finite gradients and was refused."""
        return not self.step.applied

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
        """Start agreeing on exit requests across ranks (a collective under a process group of two or more)."""
        agreement = ExitAgreement()
        self._agreement = agreement if agreement.active else None  # alone, a request holds at once

    def settle(self) -> None:
        """At the end of an applied update: submit this rank's exit request, read the agreement."""
        agreement = self._agreement
        agreed = agreement.settle(self._exit) if agreement is not None else self._exit
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
