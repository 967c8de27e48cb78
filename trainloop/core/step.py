"""One training step, written once: the microsteps (``accumulating``) and the optimizer updates (``stepping``).

A ``Step`` is the run's step in one place: its microsteps, each optimizer's update (with the
hooks' ``on_before_optimizer_step`` between preparation and application), the non-finite
verdict, the retries and what the step reports; the loop hands it the work of its states.
A ``StepPlan`` is what one optimizer's update needs, resolved before the first step
(``update_plans`` resolves a trainer's, one per optimizer, by name); a ``StepRunner`` holds
what is derived from it (the gradient-sync switch, the non-finite check's buffers) and the
state of the update in progress (its ``Loss`` item count). ``lr_find`` runs a ``StepRunner``
of its own.

The non-finite check takes one of two paths (docs/machine.md): where the optimizer skips a
non-finite update in its own kernel (``skips_on_device``), the check's flag is handed to it and
the host reads the verdict a step late from host memory (``DeviceVerdict``): no host sync; any
other optimizer waits for the verdict before it steps, and a refused update is redone.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from time import perf_counter
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import torch
import torch.distributed as dist
from torch import nn

from trainloop.core.data import DataExhaustedError, EpochIterator
from trainloop.distributed.sync import gradient_sync
from trainloop.loss import Loss
from trainloop.step_info import StepInfo
from trainloop.utils import is_distributed_model, warn_user

if TYPE_CHECKING:
    from trainloop.core.run_state import RunState, TrainerContract, TrainerView
    from trainloop.machine.trace import Trace

__all__ = [
    "DeviceVerdict",
    "LossNoneWarning",
    "Microstep",
    "NoGradientWarning",
    "NonFiniteGradCheck",
    "Step",
    "StepPlan",
    "StepRunner",
    "UpdateRunner",
    "check_forward",
    "raise_if_no_retries_left",
    "skips_on_device",
    "takes_optimizer",
    "unpack_forward_output",
    "step_runners",
    "update_plans",
]


NO_CONTEXT = contextlib.nullcontext()
"""The no-op context, one reusable object: entering it allocates nothing."""


class LossNoneWarning(UserWarning):
    """``forward`` returned ``loss=None`` while the model is wrapped by DDP or FSDP."""


class NoGradientWarning(UserWarning):
    """None of an optimizer's parameters got a gradient in its first update: its updates cannot move them."""


@dataclass(frozen=True)
class StepPlan:
    """What one training step needs, fixed for a whole run.

    Attributes:
        model: The model (as wrapped: DDP, FSDP2, or plain).
        optimizer: The optimizer of the model's parameters.
        forward: ``forward(batch) -> (loss, records)``: the loss a scalar tensor, a ``Loss``, or
            ``None`` to skip the batch; records a dict of numbers or ``None``.
        owner: How errors name ``forward`` (e.g. ``"MyTrainer.forward()"``).
        accumulation: Microsteps per optimizer update.
        grad_clip: Max gradient norm (L2), or ``None``.
        grad_scaler: An enabled ``GradScaler`` (fp16), or ``None``.
        lr_scheduler: Stepped after every applied update, or ``None``.
        check_grads: Never apply an update whose gradients hold inf or NaN: an optimizer that
            skips on the device (``skips_on_device``) is handed the verdict, any other waits for
            it (one host sync). Under a grad scaler its own check decides, whatever this says:
            an update it would skip is reported as non-finite, never applied silently.
        no_sync: Skip gradient synchronisation across ranks on all but a step's last microstep.
        autocast: The mixed-precision context ``forward`` runs under (re-enterable).
        parameters: The parameters the update clips and checks: its optimizer's, for optimizers
            built by name; ``None``: the model's.
        name: The optimizer's name, for optimizers built by name; ``None``: one built alone.
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    forward: Callable[[Any], Any]
    owner: str
    accumulation: int = 1
    grad_clip: float | None = None
    grad_scaler: torch.amp.GradScaler | None = None
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
    check_grads: bool = True
    no_sync: bool = True
    autocast: contextlib.AbstractContextManager[Any] = NO_CONTEXT
    parameters: tuple[nn.Parameter, ...] | None = None
    name: str | None = None

    def params(self) -> Iterable[nn.Parameter]:
        """The parameters the update clips and checks."""
        return self.parameters if self.parameters is not None else self.model.parameters()


def update_plans(trainer: TrainerContract, *, check_grads: bool, by_name: bool) -> dict[str, StepPlan]:
    """One plan per optimizer, by name, in update order: the one place the optimizers' two forms meet.

    A run's optimizers are always by name: one optimizer built alone is the mapping of one, named ``SINGLE``
    (``trainer.optimizers``). What the form changes is the user's ``forward`` and the parameters: optimizers built
    ``by_name`` each get ``forward(batch, name)`` and clip and check their own parameters (another update's backward
    may leave gradients on them, which the step zeroes before each update); one built alone gets ``forward(batch)``
    and the model's parameters. ``lr_find`` runs the plan of one.
    """
    settings, schedulers = trainer.settings, trainer.lr_schedulers
    plans = {}
    for name, optimizer in trainer.optimizers.items():
        plans[name] = StepPlan(
            model=trainer.model,
            optimizer=optimizer,
            forward=functools.partial(_call_with_name, trainer.forward, name) if by_name else trainer.forward,
            owner=f"{type(trainer).__name__}.forward()",
            accumulation=trainer.run_length.accumulation,
            grad_clip=settings.grad_clip,
            grad_scaler=trainer.grad_scaler,
            lr_scheduler=schedulers.get(name),
            check_grads=check_grads,
            no_sync=settings.no_sync_accumulate,
            autocast=trainer.autocast(),  # reused: an autocast object can be entered again
            parameters=tuple(p for group in optimizer.param_groups for p in group["params"]) if by_name else None,
            name=name if by_name else None,
        )
    return plans


def _call_with_name(forward: Callable[..., Any], name: str, batch: Any) -> Any:
    return forward(batch, name)


class Microstep(NamedTuple):
    """What one microstep computed.

    Attributes:
        loss: What ``forward`` returned as the loss (a scalar tensor or a ``Loss``), before any
            division or scaling; it still holds the graph's output, so detach it to keep it.
            ``None`` when the step's epoch ran out while ``forward`` skipped batches.
        records: ``forward``'s records (``{}`` for ``None``).
        data_time: Seconds spent drawing batches (skipped ones included).
    """

    loss: torch.Tensor | Loss | None
    records: Mapping[str, Any]
    data_time: float


class StepRunner:
    """Runs the microsteps and the optimizer update of ``plan``, drawing batches from ``data``.

    Args:
        plan: What the step needs.
        data: The batches (an endless iterator, e.g. an ``EpochIterator``).
        epochs: ``data`` itself, when steps end with epochs (``max_epochs``): an epoch's last
            step takes the microsteps that remain in it, and no step crosses into another epoch.
    """

    def __init__(
        self, plan: StepPlan, data: Iterator[Any], epochs: EpochIterator | None = None, kept: list[Any] | None = None
    ) -> None:
        self.plan = plan
        self.data = data
        self.epochs = epochs
        self.kept = kept
        self._draw = data
        self._replaying = False
        self.distributed = is_distributed_model(plan.model)  # it also averages gradients over ranks
        self._device = next((p.device for p in plan.params()), torch.device("cpu"))
        # Built once, entered on every microstep but a step's last: DDP's no_sync(), FSDP2's
        # set_requires_gradient_sync(False).
        sync_off = gradient_sync(plan.model, enabled=False)
        self._sync_off = sync_off if plan.no_sync and sync_off.controls_sync else None
        self._autocast = None if plan.autocast is NO_CONTEXT else plan.autocast
        self._scaler = plan.grad_scaler if plan.grad_scaler is not None and plan.grad_scaler.is_enabled() else None
        # With clipping on, the total norm clip_grad_norm_ returns answers the check for free.
        self._grad_check = (
            NonFiniteGradCheck(plan.params())
            if plan.check_grads and self._scaler is None and plan.grad_clip is None
            else None
        )
        # Optimizers that unscale inside their own step (fused ones) must step through the scaler;
        # torch marks them with this private flag, which GradScaler.step reads too.
        self._step_through_scaler = getattr(plan.optimizer, "_step_supports_amp_scaling", False)
        # Where the optimizer skips a non-finite update itself, the verdict travels on the device.
        guarded = plan.check_grads or self._scaler is not None
        self.verdict = DeviceVerdict(self._device) if guarded and skips_on_device(plan.optimizer) else None
        self._norm_found: torch.Tensor | None = None  # clipping: the norm's flag, made at first use
        self._norm_one: torch.Tensor | None = None
        self.items: torch.Tensor | int | None = None  # the step's Loss item count so far
        self.microsteps = 0  # microsteps done in the step in progress
        self.target = plan.accumulation  # the microsteps the step in progress takes
        self._divisor = plan.accumulation  # what its plain losses are divided by
        self.grad_norm: torch.Tensor | None = None  # the last update's (clipping only)
        self._reach_checked = False  # whether the first update looked for its optimizer's gradients
        if self._sync_off is None:  # nothing to switch: a microstep is the microstep itself (one call fewer)
            self.microstep = self._microstep  # type: ignore[method-assign]

    def begin(self, fresh: bool = True) -> None:
        """Start a step, its retry (``fresh``), or another optimizer's update of it (not ``fresh``).

        No microstep done, no items counted; with ``epochs``, as many microsteps as the epoch still has batches, up to
        the accumulation. With ``kept`` (several optimizers), a fresh update keeps the batches it trains on there, and
        another update replays them.
        """
        self.microsteps = 0
        self.items = None
        kept = self.kept
        if kept is not None:
            self._replaying = not fresh
            if not fresh:
                self.data = iter(kept)
                self.target = self._divisor = len(kept)
                return
            kept.clear()
            self.data = self._draw
            self.target = self._divisor = self.plan.accumulation
        if self.epochs is not None:
            self.target = self._divisor = min(self.plan.accumulation, self._left_in_epoch())

    def _left_in_epoch(self) -> int:
        left = self.epochs.remaining  # type: ignore[union-attr]
        return left or self.epochs.batches_per_epoch or 1  # type: ignore[union-attr]  # 0: a new epoch begins

    def microsteps_remain(self) -> bool:
        """Whether the step in progress needs another microstep.

        It needs ``plan.accumulation`` microsteps (a run's ``RunLength.accumulation``), or fewer for an epoch's last
        step under ``max_epochs``: ``lr_find`` asks this, and ``Step.microsteps_remain`` reads the same count.
        """
        return self.microsteps < self.target

    def microstep(self) -> Microstep:
        """Draw batches until ``forward`` returns a loss, and backpropagate it.

        A ``None`` loss does not count (the next batch is drawn). A plain loss is divided by the
        number of microsteps; a ``Loss`` is backpropagated as its sum and its count added up, for
        ``update`` to divide the gradients by. Gradients are synchronised across ranks only on
        the step's last microstep.

        With ``epochs``, a step never draws past its epoch's last batch once it has a microstep:
        when batches ``forward`` skipped used the epoch up, it ends with the microsteps it has
        (this one returns a ``None`` loss if its own batches ran out). A step with no microstep
        yet goes on in the next epoch, but never past the last.

        Raises:
            DataExhaustedError: With ``epochs``, the last epoch ran out while the step had no
                microstep (``forward`` returned ``loss=None`` for all its batches).
        """
        if self._sync_off is not None and self.microsteps + 1 < self.target:
            with self._sync_off:
                return self._microstep()
        return self._microstep()

    def _microstep(self) -> Microstep:
        plan, autocast = self.plan, self._autocast
        data_time = 0.0
        while True:
            start = perf_counter()
            batch = next(self.data)
            data_time += perf_counter() - start
            if autocast is None:  # no `with` on a no-op context: two Python calls saved per microstep
                output = plan.forward(batch)
            else:
                with autocast:
                    output = plan.forward(batch)
            if type(output) is tuple and len(output) == 2 and type(output[1]) is dict:  # the usual return
                loss, records = output
            else:
                loss, records = unpack_forward_output(output, plan.owner)
            if loss is not None:
                break
            if self._skipped_and_epoch_ended():
                return Microstep(None, {}, data_time)
        if self.kept is not None and not self._replaying:
            self.kept.append(batch)
        if type(loss) is torch.Tensor and not loss.ndim and self.items is None:  # a plain scalar loss
            divisor = self._divisor
            backward = loss / divisor if divisor > 1 else loss
        else:
            backward = self._to_backpropagate(loss)
        if self._scaler is not None:
            backward = self._scaler.scale(backward)
        backward.backward()  # type: ignore[no-untyped-call]  # torch leaves Tensor.backward unannotated
        self.microsteps += 1
        epochs = self.epochs
        if epochs is not None and epochs.remaining == 0 and not self._replaying:
            self.target = self.microsteps  # skipped batches used the epoch up: the step ends with it
        return Microstep(loss, records, data_time)

    def _skipped_and_epoch_ended(self) -> bool:
        """A batch's ``forward`` returned ``loss=None``: whether the step ends with its epoch (else draw the next)."""
        plan = self.plan
        if self._replaying:
            raise ValueError(
                f"{plan.owner} returned loss=None for a batch that the step's first update trained on: "
                "every update of a step trains on the step's batches, so skip a batch in every update or none"
            )
        if self.distributed:
            warn_user(
                "forward() returned loss=None under DDP/FSDP; the wrapped model must not "
                "have been called for this batch, or its next backward may hang or be wrong",
                LossNoneWarning, every_rank=True,
            )
        epochs = self.epochs
        if epochs is not None and epochs.remaining == 0:
            if self.microsteps:  # the step ends with its epoch, on what it accumulated
                self.target = self.microsteps
                return True
            if epochs.in_last_epoch:
                raise DataExhaustedError(
                    f"{plan.owner} returned loss=None for every batch of the last epoch's step "
                    f"(max_epochs={epochs.limit}), so it has nothing to update with"
                )
            self.target = self._divisor = min(plan.accumulation, epochs.batches_per_epoch or 1)
        return False

    def _to_backpropagate(self, loss: Any) -> torch.Tensor:
        plan = self.plan
        if isinstance(loss, Loss):
            _check_scalar(loss.sum, "Loss.sum", plan.owner)
            if self.microsteps and self.items is None:
                raise TypeError(f"{plan.owner} mixed plain losses and Loss(sum, count) in one step")
            self.items = loss.count if self.items is None else self.items + loss.count
            return loss.sum
        _check_scalar(loss, "loss", plan.owner)
        if self.items is not None:
            raise TypeError(f"{plan.owner} mixed plain losses and Loss(sum, count) in one step")
        scaled: torch.Tensor = loss / self._divisor if self._divisor > 1 else loss
        return scaled

    def update(self) -> bool:
        """The optimizer update of the step whose microsteps are done: ``prepare``, then ``apply``."""
        self.prepare()
        return self.apply()

    def prepare(self) -> None:
        """Make the step's gradients those of the update: unscale (fp16), normalise by the ``Loss`` item count.

        Between this and ``apply`` the gradients are final but for clipping: the hooks'
        ``on_before_optimizer_step`` runs there.
        """
        if not self._reach_checked:
            self._warn_if_no_gradient()
        plan = self.plan
        if self._scaler is not None:
            self._scaler.unscale_(plan.optimizer)
        if self.items is not None:
            self._normalise_by_items()
        elif self._divisor != self.target:  # an epoch ran out while forward skipped batches
            self._rescale(self._divisor / self.target)

    def apply(self) -> bool:
        """Clip, check for non-finite gradients, then step the optimizer and the lr scheduler and zero the gradients.

        With a ``verdict`` (an optimizer that skips on the device) every update after the first
        applied one is decided on the device: the optimizer skips it if the gradients are
        non-finite, the lr scheduler steps either way, and the verdict waits in host memory
        (``verdict.pending``) for ``verdict.read()``. The first is decided on the host: a fused
        optimizer builds its state in its first step, even a skipped one (fused SGD's momentum
        buffers would be left uninitialised).

        Returns:
            ``True`` if the update was applied or handed to the device; ``False`` if the
            gradients were non-finite: then nothing stepped, the gradients are left as they
            are, and a grad scaler has lowered its scale for the retry.
        """
        plan = self.plan
        if plan.grad_clip is not None:
            grad_norm = nn.utils.clip_grad_norm_(plan.params(), plan.grad_clip)
            if hasattr(grad_norm, "full_tensor"):  # an FSDP2 DTensor, replicated: no communication
                grad_norm = grad_norm.full_tensor()
            self.grad_norm = grad_norm
        verdict = self.verdict
        if verdict is not None and verdict.ready:
            self._apply_unless_found(verdict)
            return True
        if self._grads_non_finite():
            return False
        self._apply()
        if verdict is not None:
            verdict.ready = True
        return True

    def _warn_if_no_gradient(self) -> None:
        """Say once if none of the optimizer's parameters got a gradient: its updates could never move them."""
        self._reach_checked = True
        plan = self.plan
        params = [p for group in plan.optimizer.param_groups for p in group["params"]]
        if any(p.grad is not None for p in params):
            return
        which = "the optimizer" if plan.name is None else f"optimizer {plan.name!r}"
        warn_user(
            f"{which} ({type(plan.optimizer).__name__}, {len(params)} parameter(s)) moves none of its parameters: "
            f"none got a gradient in its first update, so {plan.owner}'s loss does not reach them or they are frozen "
            "(requires_grad=False); its updates change nothing",
            NoGradientWarning,
        )

    def _grads_non_finite(self) -> bool:
        """Whether the update must be refused (a grad scaler then lowers its scale for the retry)."""
        scaler = self._scaler
        if scaler is not None:
            # The step's one host sync, the one GradScaler.step would make anyway: a skipped
            # update is a retry, decided here, not a silent no-op. (torch's private API: GradScaler
            # has no public way to read what unscale_ found, and GradScaler.step reads this one.)
            found = scaler._found_inf_per_device(self.plan.optimizer).values()
            if any(bool(f.item()) for f in found):
                scaler.update()  # lowers the scale for the retry
                return True
            return False
        if self.plan.check_grads:
            # The step's one host sync: a retry must be decided before the optimizer steps.
            # With clipping on, the total norm is finite iff every gradient is.
            if self._grad_check is not None:
                return self._grad_check()
            assert self.grad_norm is not None  # no check of its own means clipping is on
            return not bool(torch.isfinite(self.grad_norm))
        return False

    def _apply(self) -> None:
        """Step the optimizer (through the grad scaler if it must), the scaler and the lr scheduler; zero the grads."""
        plan, optimizer, scaler = self.plan, self.plan.optimizer, self._scaler
        if scaler is not None and self._step_through_scaler:
            scaler.step(optimizer)
        else:
            optimizer.step()  # gradients already unscaled and known finite
        if scaler is not None:
            scaler.update()
        optimizer.zero_grad()
        if plan.lr_scheduler is not None:
            plan.lr_scheduler.step()

    def _apply_unless_found(self, verdict: DeviceVerdict) -> None:
        """Step the optimizer with the non-finite flag handed to its kernel, which skips the update if it is set.

        The scaler and the lr scheduler step, the gradients are zeroed, and the flag (and the
        loss scale) go to host memory for ``verdict.read()``: nothing here waits for the device.
        """
        plan, optimizer, scaler = self.plan, self.plan.optimizer, self._scaler
        if scaler is not None:
            # What unscale_ found, per device (torch's private API, as in _grads_non_finite).
            found = _one_flag(scaler._found_inf_per_device(optimizer).values())
        elif self._grad_check is not None:
            found = self._grad_check.found()
        else:
            found = self._norm_non_finite()
        # torch's fused kernels read this attribute (GradScaler.step sets it the same way), skip
        # the update if it is 1, and leave the step counts as they were.
        optimizer.found_inf = found  # type: ignore[attr-defined]
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf  # type: ignore[attr-defined]
        scale = None
        if scaler is not None:
            scaler.update()  # on the device: lowers the scale if found
            scale = scaler._get_scale_async()
        verdict.record(found, scale)
        optimizer.zero_grad()
        if plan.lr_scheduler is not None:
            plan.lr_scheduler.step()

    def _norm_non_finite(self) -> torch.Tensor:
        """A flag on the device, 1 if the clipped total norm is not finite (so some gradient is not)."""
        norm = self.grad_norm
        assert norm is not None  # no check of its own means clipping is on
        found = self._norm_found
        one = self._norm_one
        if found is None or one is None or found.device != norm.device:
            found = self._norm_found = torch.zeros((), device=norm.device)
            one = self._norm_one = torch.ones((), device=norm.device)
        found.zero_()
        # The check GradScaler uses; multiplying the norm by 1 leaves it as it is.
        torch._amp_foreach_non_finite_check_and_unscale_([norm], found, one)
        return found

    def _rescale(self, factor: float) -> None:
        grads = [p.grad for p in self.plan.params() if p.grad is not None]
        torch._foreach_mul_(grads, factor)
        self._divisor = self.target

    def _normalise_by_items(self) -> None:
        """Divide the step's summed gradients by its item count, over all ranks of a DDP/FSDP model."""
        grads = [p.grad for p in self.plan.params() if p.grad is not None]
        count = self.items
        assert count is not None  # a Loss was returned
        if self.distributed and dist.is_initialized():
            total = torch.as_tensor(count, dtype=torch.float32, device=self._device).clone()
            dist.all_reduce(total)  # the total over ranks; stays on the device
            torch._foreach_mul_(grads, dist.get_world_size() / total)  # a tensor factor: no host sync
        else:
            if isinstance(count, torch.Tensor) and (count.device != self._device or count.ndim):
                count = count.to(self._device, non_blocking=True).reshape(())
            torch._foreach_div_(grads, count)  # one kernel; a tensor count is not read on the host
        self.items = None


class UpdateRunner(Protocol):
    """What runs one optimizer's update of a step for ``Step``: a ``StepRunner``, or a DeepSpeed engine's."""

    plan: StepPlan
    microsteps: int
    target: int
    verdict: DeviceVerdict | None
    grad_norm: torch.Tensor | None

    def begin(self, fresh: bool = True) -> None:
        """Start a step, its retry (``fresh``), or another optimizer's update of its batches."""

    def microstep(self) -> Microstep:
        """Draw batches until ``forward`` returns a loss, and backpropagate it."""

    def prepare(self) -> None:
        """Make the gradients those of the update (the hooks' ``on_before_optimizer_step`` runs after it)."""

    def apply(self) -> bool:
        """Apply the update; ``False``: refused, its gradients non-finite."""


def step_runners(
    trainer: TrainerContract, data: Iterator[Any], *, epochs: EpochIterator | None, by_name: bool
) -> dict[str, StepRunner]:
    """One ``StepRunner`` per optimizer of ``trainer``, by name, in update order; several keep the step's batches."""
    plans = update_plans(trainer, check_grads=trainer.settings.detect_non_finite_grads, by_name=by_name)
    kept: list[Any] | None = [] if len(plans) > 1 else None
    return {name: StepRunner(plan, data, epochs=epochs, kept=kept) for name, plan in plans.items()}


class Step:
    """One training step of a run, in one place: its microsteps, each optimizer's update, the verdict and the retries.

    The loop's states and edges hand it their work: ``begin`` (the ``begin_step`` edge, once the loop counted the
    step), ``microstep`` (``accumulating``), ``update`` (``stepping``), ``next_update``, ``retry`` and ``redo``; the
    machine's conditions ask ``microsteps_remain``, ``updates_remain`` and ``applied``. It calls the hooks'
    ``on_before_step``, and ``on_before_optimizer_step`` between an update's preparation and its application, through
    the run's dispatch as it was at construction. It writes what the step reports (``run.step_info``: losses, records,
    items, data and step time, grad norms, retries, a skipped update), ``run.updating`` and ``run.verdicts`` (the
    device verdicts by optimizer name, for a checkpoint).

    The optimizers are always by name (``update_plans``): one runner per optimizer, in update order; a step with
    several trains each on the step's batches (kept by the first update, replayed by the others: ``step_runners``).

    Args:
        trainer: The trainer whose components, settings and logger the step uses.
        run: The run state whose step part the step writes.
        runners: What runs each optimizer's update, by name, in update order (``step_runners``; under DeepSpeed
            its engine's, ``trainloop.core.deepspeed``).
        by_name: Whether ``build_optimizer()`` returned optimizers by name: ``forward`` then takes the name, and the
            step info has losses and grad norms by name too.
        trace: The run's trace, where a skipped update is marked, or ``None``.

    Attributes:
        retries: Retries of the step in progress.
        applied: Whether the last update was applied (else its gradients were non-finite and it was refused).
        runner: The update in progress.
        verdicts: The device verdicts of the optimizers that skip a non-finite update on the device.
    """

    def __init__(
        self,
        trainer: TrainerContract,
        run: RunState,
        runners: Mapping[str, UpdateRunner],
        *,
        by_name: bool,
        trace: Trace | None,
    ) -> None:
        self.trainer = trainer
        self.run = run
        self.by_name = by_name
        self.trace = trace
        self.runners = tuple(runners.values())
        self.names = tuple(runners)
        self.optimizers = tuple(runner.plan.optimizer for runner in self.runners)
        self.runner = self.runners[0]
        run.updating = self.names[0]
        verdicts = ((name, runner.verdict) for name, runner in zip(self.names, self.runners, strict=True))
        by_optimizer = {name: verdict for name, verdict in verdicts if verdict is not None}
        run.verdicts = dict(by_optimizer)
        self.verdicts = tuple(by_optimizer.values())
        restored, run.restored_verdicts = run.restored_verdicts or {}, None
        for name, verdict in by_optimizer.items():
            if name in restored:  # the resumed run decides as the unbroken one would have
                verdict.load_state_dict(restored[name])
        self._before_step = run.dispatch["on_before_step"]
        self._before_optimizer_step = run.dispatch["on_before_optimizer_step"]
        self._clipping = trainer.settings.grad_clip is not None
        self.retries = 0
        self.applied = True
        self.loss_scale = 0.0  # fp16: GradScaler's scale after the last refused update
        self._index = 0  # the update in progress, in the step's updates
        self._recorded = (0, 0, 0)  # the step's losses, records and items recorded before the update in progress
        self._start = 0.0
        self.seconds = 0.0  # the last done step's time

    def begin(self) -> None:
        """A new step: fresh step info, its first update from zero gradients, then the hooks' ``on_before_step``."""
        run = self.run
        self.retries = 0
        run.step_info = StepInfo()
        self._start = perf_counter()
        self._recorded = (0, 0, 0)
        if self._index:  # another update's backward left gradients on this one's parameters
            self._index = 0
            self.runner = self.runners[0]
            run.updating = self.names[0]
            self.zero_grads()
        self.runner.begin()
        trainer = self.trainer
        for fn in self._before_step:
            fn(trainer)

    def microstep(self) -> None:
        """One microstep (forward and backward), recorded in the step info."""
        loss, records, data_time = self.runner.microstep()
        info = self.run.step_info
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
        if self.by_name:
            info.losses.setdefault(self.run.updating, []).append(value)

    def microsteps_remain(self) -> bool:
        """Whether the update in progress needs another microstep (``StepRunner.microsteps_remain``)."""
        runner = self.runner
        return runner.microsteps < runner.target

    def update(self) -> bool:
        """The update in progress: prepare, the hooks' ``on_before_optimizer_step``, apply.

        Where the optimizer skips non-finite updates on the device, the verdict of the previous step's update is read
        first (from host memory: no wait).

        Returns:
            Whether the step is done: its last update applied (or handed to the device).

        Raises:
            RuntimeError: The update was refused and no retry is left (``raise_if_no_retries_left``).
        """
        run, runner, trainer = self.run, self.runner, self.trainer
        verdict = runner.verdict
        if verdict is not None and verdict.pending:  # the last step's: nothing retries after it
            self.read_verdict(run.step - 1, verdict)
        runner.prepare()
        for fn in self._before_optimizer_step:
            fn(trainer)
        self.applied = applied = runner.apply()
        if self._clipping:
            info = run.step_info
            info.grad_norm = runner.grad_norm
            if self.by_name:
                info.grad_norms[run.updating] = runner.grad_norm  # type: ignore[assignment]  # set: clipping
        if not applied:
            self.loss_scale = raise_if_no_retries_left(trainer, self.retries)
            return False
        if self._index + 1 < len(self.runners):
            return False  # the step's next update follows (next_update)
        run.step_info.step_time = self.seconds = perf_counter() - self._start
        return True

    def updates_remain(self) -> bool:
        """Whether another optimizer's update of the step follows."""
        return self._index + 1 < len(self.runners)

    def next_update(self) -> None:
        """The next optimizer's update of the step, on the step's batches, from zero gradients."""
        index = self._index = self._index + 1
        info = self.run.step_info
        self._recorded = (len(info.loss), len(info.records), len(info.items))
        self.runner = self.runners[index]
        self.run.updating = self.names[index]
        self.zero_grads()
        self.runner.begin(fresh=False)

    def retry(self) -> None:
        """Drop the update whose gradients were not finite, and what its try recorded; count the retry."""
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
        run = self.run
        info, (losses, records, items) = run.step_info, self._recorded
        del info.loss[losses:], info.records[records:], info.items[items:]
        info.losses.pop(run.updating, None)
        info.grad_norms.pop(run.updating, None)
        info.non_finite_grad_retries = self.retries

    def redo(self) -> None:
        """The refused update again, on fresh batches."""
        self.runner.begin()

    def zero_grads(self) -> None:
        """Zero the gradients of every optimizer's parameters."""
        for optimizer in self.optimizers:
            optimizer.zero_grad()

    def read_verdicts(self) -> None:
        """Read this step's pending verdicts now (the run validates, saves or ends after it: never on an unread one)."""
        step = self.run.step
        for verdict in self.verdicts:
            if verdict.pending:
                self.read_verdict(step, verdict)

    def read_verdict(self, step: int, verdict: DeviceVerdict) -> None:
        """Read whether an update of ``step`` was skipped on the device; report a skip, or raise past the limit."""
        t = self.trainer
        skipped, scale = verdict.read()
        if not skipped:
            return
        in_a_row = verdict.skipped_in_a_row
        self.run.step_info.skipped_update = step
        if self.trace is not None:
            self.trace.mark_skipped(step)
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


def unpack_forward_output(output: Any, owner: str) -> tuple[Any, Mapping[str, Any]]:
    """Check what ``forward`` returned and split it into ``(loss, records)``.

    Raises:
        TypeError: It is not a pair, or the records are neither a dict nor ``None``.
    """
    try:
        loss, records = output
    except (TypeError, ValueError):
        raise TypeError(f"{owner} must return (loss, records), got {type(output).__name__}") from None
    if records is None:
        return loss, {}
    if type(records) is not dict and not isinstance(records, Mapping):
        raise TypeError(f"{owner} must return records as a dict of numbers (or None), got {type(records).__name__}")
    return loss, records


def _check_scalar(loss: Any, what: str, owner: str) -> None:
    if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
        got = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise TypeError(f"{owner} must return a scalar tensor {what}, got {got}")


class NonFiniteGradCheck:
    """Answers "does any gradient hold inf or NaN?" for a fixed set of parameters.

    It uses the kernel ``GradScaler`` itself uses (``_amp_foreach_non_finite_check_and_unscale_``
    with an inverse scale of 1, so gradients are left untouched): about 10 µs on a small CPU
    model against ~125 µs for an infinity-norm. That kernel has no bfloat16 version on CUDA, so
    bfloat16 gradients (a model kept in bf16, DeepSpeed's bf16) take one foreach infinity-norm
    instead, on every device alike. Buffers are allocated once. Parameters sharded
    as ``DTensor`` (FSDP2) are checked on their local shard and the answer is all-reduced, so
    every rank decides the same.

    Args:
        params: The parameters whose gradients to check.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter]) -> None:
        groups: dict[tuple[torch.device, torch.dtype], list[torch.nn.Parameter]] = defaultdict(list)
        self.sharded = False
        for p in params:
            if p.requires_grad:
                local = _local(p)
                self.sharded |= local is not p
                groups[(local.device, local.dtype)].append(p)
        devices = {device for device, _ in groups} or {torch.device("cpu")}
        # 0-dim, as fused optimizers take found_inf (their step counts are 0-dim).
        self._found = {d: torch.zeros((), device=d) for d in devices}
        self._inv_scale = {d: torch.ones((), device=d) for d in devices}
        # Per group, with its device's buffers: nothing is looked up per call.
        self._groups = [
            (ps, self._found[d], self._inv_scale[d], dtype == torch.bfloat16) for (d, dtype), ps in groups.items()
        ]
        self._dirty = False

    def __call__(self) -> bool:
        """True if any gradient is non-finite. Synchronises with the device once (per device)."""
        if self._dirty:  # the kernel only ever sets the flag, so clear it after a hit alone
            for found in self._found.values():
                found.zero_()
        self._launch()
        # The deliberate host sync of the step: the retry decision needs the answer now.
        dirty = False
        for found in self._found.values():
            dirty = dirty or bool(found.item())
        self._dirty = dirty
        return dirty

    def found(self) -> torch.Tensor:
        """A flag on the device, 1 if any gradient is non-finite; nothing waits for it.

        The flag is this check's buffer, overwritten by its next call (a fresh sum over
        devices when the parameters span several).
        """
        for found in self._found.values():
            found.zero_()  # the host never learns whether it was set
        self._launch()
        self._dirty = True  # for __call__
        return _one_flag(self._found.values())

    def _launch(self) -> None:
        sharded = self.sharded
        for params, found, inv_scale, bf16 in self._groups:
            grads = [_local(p.grad) if sharded else p.grad for p in params if p.grad is not None]
            if not grads:
                continue
            if bf16:  # an infinity-norm is inf or NaN where any element is
                norms = torch._foreach_norm(grads, float("inf"))
                found.copy_(torch.maximum(found, torch.stack(norms).isfinite().all().logical_not()))
            else:
                torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv_scale)
        if sharded and dist.is_available() and dist.is_initialized():
            for found in self._found.values():
                dist.all_reduce(found, op=dist.ReduceOp.MAX)


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` skips a non-finite update inside its own kernel when handed the flag.

    torch's fused optimizers do (``fused=True``: Adam, AdamW, SGD, Adagrad): they carry
    ``_step_supports_amp_scaling``, as GradScaler reads it, and their ``step`` hands
    ``self.found_inf`` to the kernel. Their foreach and for-loop implementations refuse the
    flag, and another optimizer may carry the mark for GradScaler's older contract (a
    ``grad_scaler`` argument to ``step``), so only torch's own ``step`` with every parameter
    group fused qualifies.
    """
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        return False
    if not getattr(type(optimizer).step, "__module__", "").startswith("torch.optim."):
        return False
    return all(group.get("fused") for group in optimizer.param_groups)


class DeviceVerdict:
    """Whether the last update handed to the device was skipped, read a step late without a host sync.

    ``record`` copies the flag (and fp16's loss scale) into a host buffer made once (on CUDA
    pinned, the copy non-blocking, an event recorded after it; on another accelerator the copy
    waits, so the answer is right, if not free); ``read`` takes it from there
    through a NumPy view made with the buffer. By then the device has normally long finished
    that update, so the event is passed at once; if the host ran further ahead, it waits for
    that update alone, while the device goes on with the work queued after it.

    One per optimizer.

    Args:
        device: The device of the optimizer's parameters.

    Attributes:
        ready: Whether updates may be decided on the device (after the first applied one).
        pending: Whether a recorded verdict has not been read yet.
        skipped_in_a_row: Skipped updates read in a row, up to the last read.

    A checkpoint keeps ``ready`` and ``skipped_in_a_row`` (``state_dict``): a resumed run decides its first update
    where the unbroken run does, and bounds the skips in a row across the resume.
    """

    def __init__(self, device: torch.device) -> None:
        self._cuda = cuda = device.type == "cuda"
        self._host = torch.zeros(2, pin_memory=cuda)
        self._view = self._host.numpy()  # made once: a read is a NumPy read, not a Tensor call
        self._found, self._scale = self._host[0], self._host[1]
        self._event = torch.cuda.Event() if cuda else None  # type: ignore[no-untyped-call]  # unannotated in torch
        self.ready = False
        self.pending = False
        self.skipped_in_a_row = 0

    def state_dict(self) -> dict[str, Any]:
        """Whether updates are decided on the device yet, and the skips in a row up to the last read verdict.

        The loop reads a pending verdict before it saves; a state taken earlier (a hook's ``on_after_step``) counts
        up to the verdict before.
        """
        return {"ready": self.ready, "skipped_in_a_row": self.skipped_in_a_row}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Go on from what ``state_dict`` returned."""
        self.ready = bool(state["ready"])
        self.skipped_in_a_row = int(state["skipped_in_a_row"])

    def record(self, found: torch.Tensor, scale: torch.Tensor | None = None) -> None:
        """Copy the update's flag (and the loss scale after it) to host memory, without waiting."""
        cuda = self._cuda
        self._found.copy_(found, non_blocking=cuda)
        if scale is not None:
            self._scale.copy_(scale.reshape(()), non_blocking=cuda)
        if self._event is not None:
            self._event.record()
        self.pending = True

    def read(self) -> tuple[bool, float]:
        """Whether the recorded update was skipped, and the loss scale after it (0 without fp16)."""
        if self._event is not None and not self._event.query():  # type: ignore[no-untyped-call]
            self._event.synchronize()
        self.pending = False
        skipped = bool(self._view[0])
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if skipped else 0
        return skipped, float(self._view[1])


def _one_flag(flags: Iterable[torch.Tensor]) -> torch.Tensor:
    """One non-finite flag from one per device: the flag itself, or any of them set, on the first one's device."""
    first, *rest = flags
    if not rest:
        return first
    total = first.clone()
    for flag in rest:
        total += flag.to(first.device, non_blocking=True)
    return total.clamp_(max=1.0)  # the fused kernels skip on exactly 1 (and subtract it from the step counts)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    # DTensor keeps its shard in ``_local_tensor``; ``to_local()`` would build a view each call.
    return getattr(tensor, "_local_tensor", tensor)


def takes_optimizer(forward: Callable[..., Any]) -> bool:
    """Whether a bound ``forward`` takes the name of the optimizer being updated (``forward(batch, optimizer)``)."""
    try:
        parameters = list(inspect.signature(forward).parameters.values())
    except (TypeError, ValueError):  # no signature to read (a builtin): called with the batch alone
        return False
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2 or any(p.kind is p.VAR_POSITIONAL for p in parameters)


def check_forward(forward: Callable[..., Any], owner: str, optimizers: Sequence[str] | None) -> None:
    """Refuse a ``forward`` that cannot be called as the run's optimizers need.

    Args:
        forward: The trainer's bound ``forward``.
        owner: How errors name it (``"MyTrainer.forward()"``).
        optimizers: The optimizers' names when the run has them by name (several), else ``None``.

    Raises:
        TypeError: Several optimizers and a ``forward(batch)``, or one optimizer and a ``forward``
            that needs an optimizer's name.
    """
    takes = takes_optimizer(forward)
    if optimizers is not None and not takes:
        raise TypeError(
            f"{owner} takes no optimizer, but the run updates several ({', '.join(optimizers)}) and calls "
            "forward once per update with the optimizer's name: write forward(self, batch, optimizer)"
        )
    if optimizers is None and takes:
        required = [
            p for p in list(inspect.signature(forward).parameters.values())[1:]
            if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        if required:
            raise TypeError(
                f"{owner} needs an optimizer's name ({required[0].name}), but build_optimizer() returned one "
                "optimizer: return them by name ({'name': optimizer}) or give the argument a default"
            )
