"""The learning-rate range test.

Sweep the lr exponentially over a few optimizer steps and suggest the one at which the loss falls fastest.

The test (Smith, "Cyclical Learning Rates for Training Neural Networks", 2017) trains for
``num_iterations`` steps while the learning rate grows from ``start_lr`` to ``end_lr`` by a
constant factor per step, records the loss, and stops early once the loss blows up. The model,
the optimizer (and a grad scaler) and the global random generators are put back exactly as
they were, so the test leaves no trace on the run that follows::

    result = lr_find(MyTrainer(max_steps=10_000))
    result.suggestion           # e.g. 0.03
    result.plot("lr_find.png")  # needs matplotlib

    result = lr_find(LrFindComponents(model, optimizer, loader, lambda batch: loss_of(batch)))
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Annotated, Any

import torch
import torch.distributed as dist
from pydantic import (
    Field,
    InstanceOf,
    SkipValidation,
    ValidationError,
    validate_call,
)
from pydantic.dataclasses import dataclass as pydantic_dataclass
from pydantic_core import PydanticCustomError
from torch import nn

from trainloop.core.data import EpochIterator
from trainloop.core.rng import get_rng_state, set_rng_state
from trainloop.core.run_state import SINGLE
from trainloop.core.step import StepPlan, StepRunner, update_plans
from trainloop.loss import Loss
from trainloop.lr_find.result import LrFindResult, steepest_descent
from trainloop.machine.table import State
from trainloop.settings.types import PositiveFloat, PositiveInt
from trainloop.trainer import BaseTrainer
from trainloop.utils import is_distributed_model, module_modes_kept

__all__ = ["LrFindComponents", "LrFindResult", "lr_find"]

logger = logging.getLogger("trainloop")

AtLeastTwo = Annotated[int, Field(ge=2, strict=True)]
Smoothing = Annotated[float, Field(ge=0, lt=1, strict=True, allow_inf_nan=False)]
AboveOne = Annotated[float, Field(gt=1, strict=True, allow_inf_nan=False)]


@pydantic_dataclass(frozen=True)
class LrFindComponents:
    """What ``lr_find`` trains when there is no trainer: the pieces of one training step.

    Attributes:
        model: The model (in train mode during the test; its modes are restored afterwards).
        optimizer: The optimizer of the model's parameters. Each param group's lr is swept in
            proportion to the lr it has now (see ``lr_find``).
        data: The batches: a re-iterable (a ``DataLoader``, a list), iterated again when it runs
            out, or an iterator that yields at least ``num_iterations`` batches.
        loss_fn: ``fn(batch) -> loss``: a scalar tensor, a ``Loss``
            ``(sum, count)``, or ``None`` to skip the batch (the next one is drawn). Run any
            autocast inside it.
        gradient_accumulation_steps: Batches (forward + backward) per optimizer step.
        grad_clip: Max gradient norm (L2) before each optimizer step; ``None``: no clipping.
        grad_scaler: A ``torch.amp.GradScaler`` for fp16; its state is restored afterwards too.
    """

    model: InstanceOf[nn.Module]
    optimizer: InstanceOf[torch.optim.Optimizer]
    # InstanceOf: pydantic would otherwise wrap an Iterable in a one-shot validating iterator.
    data: InstanceOf[Iterable[Any]]
    loss_fn: Callable[[Any], Any]
    gradient_accumulation_steps: PositiveInt = 1
    grad_clip: PositiveFloat | None = None
    grad_scaler: InstanceOf[torch.amp.GradScaler] | None = None


@validate_call
def lr_find(
    # Checked in the body: pydantic would name a positional argument by its index, not its name.
    trainer_or_components: SkipValidation[InstanceOf[BaseTrainer] | InstanceOf[LrFindComponents]],
    *,
    start_lr: PositiveFloat = 1e-7,
    end_lr: PositiveFloat = 1.0,
    num_iterations: AtLeastTwo = 100,
    smoothing: Smoothing = 0.05,
    divergence_threshold: AboveOne = 4.0,
) -> LrFindResult:
    """Run a learning-rate range test and restore everything it changed.

    Iteration ``i`` (``0 <= i < num_iterations``) takes one optimizer step at
    ``lr = start_lr * (end_lr / start_lr) ** (i / (num_iterations - 1))``, set by a
    ``torch.optim.lr_scheduler.LambdaLR``. With several param groups the group with the largest
    lr follows that sweep and every other group keeps its ratio to it (a group at lr 0 stays
    frozen). The sweep stops early when the smoothed loss exceeds ``divergence_threshold``
    times the best smoothed loss so far (for a negative best: rises above it by
    ``(divergence_threshold - 1) * |best|``) or the loss is not finite; that iteration takes no
    optimizer step.

    Afterwards the parameters and buffers, the optimizer's state and param groups, the grad
    scaler's state, the parameters' ``.grad``, the modules' train/eval modes and the global
    random generators (Python, NumPy, torch, CUDA) are exactly what they were before.

    Given a trainer (not yet trained), the test seeds like ``train()`` (``settings.seed``),
    builds the data loader, model, optimizer and grad scaler through its ``build_*`` methods,
    and computes the loss with ``trainer.forward`` under ``trainer.autocast()``, honouring
    ``gradient_accumulation_steps`` and ``grad_clip`` from its settings. It builds no lr
    scheduler and no hooks, does not touch the state machine, and afterwards gives the
    trainer's ``data_loader``, ``model``, ``optimizer`` and ``grad_scaler`` attributes back what
    they held before (``train()`` builds its own).

    Under DDP/FSDP every rank must call it; the loss is averaged over ranks each iteration (one
    collective) so that all ranks stop together and agree on the suggestion.

    Args:
        trainer_or_components: A ``BaseTrainer`` that has not started
            ``train()``, or the pieces of a training step as ``LrFindComponents``.
        start_lr: The first learning rate (> 0).
        end_lr: The last learning rate (> ``start_lr``).
        num_iterations: Optimizer steps of the full sweep (>= 2).
        smoothing: Weight of the newest loss in the exponential moving average of the losses,
            in [0, 1); ``0`` turns smoothing off. Smaller smooths more.
        divergence_threshold: Stop once the smoothed loss is this many times its best (> 1).

    Returns:
        The learning rates, smoothed and raw losses, the suggestion, and where it diverged.

    Raises:
        pydantic.ValidationError: A parameter is invalid; the error names it.
        RuntimeError: The trainer has already started ``train()``.
        ValueError: Every param group has learning rate 0, or the trainer's settings declare ``deepspeed``.
        TypeError: The loss is not a scalar tensor (or ``forward`` returned no ``(loss, records)``).
    """
    if not isinstance(trainer_or_components, (BaseTrainer, LrFindComponents)):
        raise ValidationError.from_exception_data(
            "lr_find",
            [{
                "type": PydanticCustomError(
                    "is_instance_of", "Input should be a BaseTrainer or LrFindComponents, got {got}",
                    {"got": type(trainer_or_components).__name__},
                ),
                "loc": ("trainer_or_components",),
                "input": trainer_or_components,
            }],
        )
    if isinstance(trainer_or_components, BaseTrainer) and trainer_or_components.settings.deepspeed is not None:
        raise ValueError(
            "lr_find(): the trainer's settings declare deepspeed, whose engine the range test does not drive: "
            "find the lr without deepspeed (the same model and optimizer), then train with it"
        )
    if end_lr <= start_lr:
        raise ValidationError.from_exception_data(
            "lr_find",
            [{"type": "greater_than", "loc": ("end_lr",), "input": end_lr, "ctx": {"gt": start_lr}}],
        )
    with contextlib.ExitStack() as stack:
        stack.enter_context(_random_state_kept())
        if isinstance(trainer_or_components, BaseTrainer):
            plan, data = stack.enter_context(_trainer_plan(trainer_or_components))
            log = trainer_or_components.logger
        else:
            plan, data = _components_plan(trainer_or_components), trainer_or_components.data
            log = logger
        stack.enter_context(_training_state_kept(plan))
        sweep = _Sweep(plan, data, start_lr, end_lr, num_iterations)
        result = sweep.run(smoothing, divergence_threshold)
    log.info(
        "LR range test: %d of %d iterations, lr %.3g to %.3g; suggestion %s; diverged at %s",
        len(result.lrs), num_iterations, result.lrs[0], result.lrs[-1],
        _Lr(result.suggestion), _Lr(result.diverged_at),
    )
    return result


class _Lr:
    """An optional lr for a log message, formatted only if the message is emitted."""

    def __init__(self, value: float | None) -> None:
        self.value = value

    def __str__(self) -> str:
        return "none" if self.value is None else format(self.value, ".3g")


class _Sweep:
    """One range test over a step plan: the optimizer steps and the loss bookkeeping.

    The microsteps and the update are the trainer's own (``StepRunner``); the sweep adds the
    lr schedule, the loss average over ranks, and the divergence check before each update.
    """

    def __init__(
        self, plan: StepPlan, data: Iterable[Any], start_lr: float, end_lr: float, num_iterations: int
    ) -> None:
        self.plan = plan
        self.data = data
        self.optimizer = plan.optimizer
        self.num_iterations = num_iterations
        self.distributed = is_distributed_model(plan.model) and dist.is_available() and dist.is_initialized()
        lrs = [float(group["lr"]) for group in self.optimizer.param_groups]
        self.reference = max(range(len(lrs)), key=lrs.__getitem__)
        reference_lr = lrs[self.reference]
        if reference_lr <= 0:
            raise ValueError(
                "lr_find(): every param group of the optimizer has learning rate 0, so there is no "
                "ratio to sweep them by; give the optimizer a positive lr (its value does not matter)"
            )
        span = end_lr / start_lr
        last = num_iterations - 1

        def factor(i: int) -> float:
            # Closed form rather than repeated multiplication: lands exactly on end_lr.
            return float(start_lr * span ** (min(i, last) / last) / reference_lr)

        self.factor = factor

    def run(self, smoothing: float, divergence_threshold: float) -> LrFindResult:
        optimizer = self.optimizer
        for group in optimizer.param_groups:
            # A scheduler built earlier left its own base lr here, which LambdaLR would take
            # instead of the current lr; the optimizer's state dict, restored afterwards, has it.
            group.pop("initial_lr", None)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, self.factor)
        data = EpochIterator(self.data)
        runner = StepRunner(self.plan, data)
        lrs: list[float] = []
        raw: list[float] = []
        smoothed: list[float] = []
        best = math.inf
        ema = 0.0
        diverged_at = None
        try:
            for i in range(self.num_iterations):
                lr = float(optimizer.param_groups[self.reference]["lr"])
                loss_tensor = self._forward_backward(runner)
                loss = float(loss_tensor)  # the iteration's one host sync: divergence is decided now
                # Bias-corrected moving average: starting it at the first loss instead would give
                # that one noisy batch a weight of (1 - smoothing) ** i: a false early descent.
                ema = (1 - smoothing) * ema + smoothing * loss
                average = ema / (1 - (1 - smoothing) ** (i + 1)) if smoothing else loss
                lrs.append(lr)
                raw.append(loss)
                smoothed.append(average)
                if not math.isfinite(average) or average > best + (divergence_threshold - 1) * abs(best):
                    diverged_at = lr
                    break
                best = min(best, average)
                runner.update()  # a grad scaler may skip it (inf gradients): harmless here
                optimizer.zero_grad(set_to_none=True)
                if i + 1 < self.num_iterations:
                    with warnings.catch_warnings():
                        # A grad scaler may skip the first optimizer step (inf gradients): harmless here.
                        warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step\\(\\)` before")
                        scheduler.step()
        finally:
            data.close()
            optimizer.zero_grad(set_to_none=True)
        return LrFindResult(
            lrs=tuple(lrs),
            losses=tuple(smoothed),
            suggestion=steepest_descent(lrs, smoothed, smoothing),
            diverged_at=diverged_at,
            raw_losses=tuple(raw),
        )

    def _forward_backward(self, runner: StepRunner) -> torch.Tensor:
        """All microsteps of one iteration; returns the iteration's mean loss (a detached tensor).

        With ``Loss`` the gradients are left summed, and the item count kept by the runner to
        divide by in its update: nothing is unscaled or divided before the divergence check
        decides that this iteration steps at all.
        """
        runner.begin()
        total: torch.Tensor | None = None
        while runner.microsteps_remain():  # the machine's accumulating edge asks the same
            loss = runner.microstep().loss
            assert loss is not None  # None only when steps end with epochs, which lr_find's do not
            value = loss.sum.detach() if isinstance(loss, Loss) else loss.detach() / self.plan.accumulation
            total = value if total is None else total + value
        assert total is not None
        # Copies: the all-reduces below work in place, and the count may be the caller's tensor.
        total = total.float().clone()
        if self.distributed:
            dist.all_reduce(total)
        if runner.items is None:
            return total / dist.get_world_size() if self.distributed else total
        count = torch.as_tensor(runner.items, dtype=torch.float32, device=total.device).clone()
        if self.distributed:
            dist.all_reduce(count)
        return total / count


def _components_plan(components: LrFindComponents) -> StepPlan:
    loss_fn = components.loss_fn
    return StepPlan(
        model=components.model,
        optimizer=components.optimizer,
        forward=lambda batch: (loss_fn(batch), None),
        owner="lr_find()'s loss function",
        accumulation=components.gradient_accumulation_steps,
        grad_clip=components.grad_clip,
        grad_scaler=components.grad_scaler,
        check_grads=False,  # the sweep checks the loss instead, before each update
    )


@contextlib.contextmanager
def _trainer_plan(trainer: BaseTrainer) -> Iterator[tuple[StepPlan, Iterable[Any]]]:
    """Build a trainer's step through its ``build_*`` methods, outside ``train()``.

    ``forward`` reads ``self.model`` (and maybe the others), so the trainer's loop holds the built
    objects for the test's duration; they get their previous values (or absence) back.
    """
    if trainer.state is not State.IDLE:
        raise RuntimeError(
            "lr_find() needs a trainer that has not started train(); this one is in state "
            f"{trainer.state.value!r}"
        )
    loop = trainer.loop
    with loop.components_kept():
        loop.build_components(lr_scheduler=False)  # what train()'s building state does, in its order
        if loop.run_state.named_optimizers:
            names = ", ".join(loop.run_state.optimizers)
            declared = trainer.settings.optimizers is not None
            source = "the settings declare" if declared else f"{type(trainer).__name__}.build_optimizer() returned"
            alone = "settings with optimizer: that one alone" if declared else "a trainer that returns it alone"
            raise ValueError(
                f"lr_find() sweeps one optimizer's learning rate, and {source} several ({names}): run the test "
                f"with one of them, e.g. {alone}"
            )
        # No lr scheduler, no hooks; the sweep checks the loss instead, before each update.
        yield update_plans(trainer, check_grads=False, by_name=False)[SINGLE], trainer.data_loader


@contextlib.contextmanager
def _random_state_kept() -> Iterator[None]:
    """Put the global generators (Python, NumPy, torch, CUDA) back afterwards.

    The test draws (shuffling, dropout, a seed_all), but a run started afterwards sees the same numbers.
    """
    state = get_rng_state()
    try:
        yield
    finally:
        set_rng_state(state)


@contextlib.contextmanager
def _training_state_kept(plan: StepPlan) -> Iterator[None]:
    """Snapshot what the sweep changes and put it back exactly, also when the sweep raises."""
    model, optimizer, scaler = plan.model, plan.optimizer, plan.grad_scaler
    model_state = copy.deepcopy(model.state_dict())
    optimizer_state = copy.deepcopy(optimizer.state_dict())
    scaler_state = copy.deepcopy(scaler.state_dict()) if scaler is not None else None
    params = list(model.parameters())
    # The original gradient tensors are kept aside (not copied): the sweep accumulates into
    # fresh ones, so these stay untouched.
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    # LRScheduler wraps optimizer.step in an instance attribute; remember whether one was there.
    patched = {key: optimizer.__dict__[key] for key in ("step", "_opt_called") if key in optimizer.__dict__}
    try:
        with module_modes_kept(model, train=True):
            yield
    finally:
        with torch.no_grad():
            model.load_state_dict(model_state)
        optimizer.load_state_dict(optimizer_state)
        if scaler is not None and scaler_state:
            scaler.load_state_dict(scaler_state)
        for p, grad in zip(params, grads):
            p.grad = grad
        for key in ("step", "_opt_called"):
            if key in patched:
                optimizer.__dict__[key] = patched[key]
            else:
                optimizer.__dict__.pop(key, None)
