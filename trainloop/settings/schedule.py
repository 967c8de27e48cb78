"""The learning-rate schedule declared in settings: constant, linear or cosine, with warmup.

::

    {"name": "cosine", "warmup_steps": 500, "final_lr_ratio": 0.1}
    {"name": "cosine", "warmup_steps": 2000, "decay_steps": 600000, "final_lr": 6e-5}  # nanoGPT's get_lr

The schedule is a closed-form factor of each param group's own initial learning rate
(``lr_factor``), run by a ``torch.optim.lr_scheduler.LambdaLR`` (``build_lr_scheduler``). It is a
function of the step and the run's settings alone, so a resumed run follows its own settings,
and ``describe_schedule_change`` says what that does when they differ from the checkpoint's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from trainloop.settings.types import NonNegativeFloat, NonNegativeInt, PositiveInt
from trainloop.utils import warn_user

__all__ = ["LR_SCHEDULES", "LrScheduleSettings", "build_lr_scheduler", "describe_schedule_change", "lr_factor"]

#: The schedule names ``LrScheduleSettings`` accepts.
LR_SCHEDULES = ("constant", "linear", "cosine")

_WarmupRatio = Annotated[float, Field(ge=0, lt=1, strict=True, allow_inf_nan=False)]
_UnitRatio = Annotated[float, Field(ge=0, le=1, strict=True, allow_inf_nan=False)]


class LrScheduleSettings(BaseModel):
    """A learning-rate schedule over ``max_steps`` optimizer steps, with optional linear warmup.

    Warmup: steps ``1..W`` use ``lr * k / (W + 1)`` (no step is wasted at lr 0), and the
    schedule proper starts at ``lr`` on step ``W + 1``. It then decays over ``D = E - W``
    steps, ``j = 0..D-1``, where ``E`` is ``decay_steps`` (default ``max_steps``): ``constant``
    keeps ``lr``; ``linear`` uses ``lr * (1 - (1 - r) * j / D)``; ``cosine`` uses
    ``lr * (r + (1 - r) * (1 + cos(pi * j / D)) / 2)``, where ``r`` is ``final_lr_ratio`` (or
    ``final_lr / lr``); both reach ``lr * r`` at step ``E + 1`` and stay there. With
    ``decay_steps = max_steps`` (the default) the floor is reached as the last step completes.
    ``lr`` is each param group's initial learning rate. ``build_lr_scheduler`` builds it.
    That is nanoGPT's ``get_lr`` with ``warmup_iters = W``, ``lr_decay_iters = E`` and
    ``min_lr = final_lr``: step ``k + 1`` runs at ``get_lr(k)``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True, use_attribute_docstrings=True)

    name: Literal["constant", "linear", "cosine"]
    """The schedule after warmup: ``constant``, ``linear`` (decay) or ``cosine`` (decay)."""
    warmup_steps: NonNegativeInt | None = None
    """Linear warmup length in steps; excludes ``warmup_ratio``. ``None``/``0``: no warmup."""
    warmup_ratio: _WarmupRatio | None = None
    """Linear warmup length as a fraction of ``max_steps``, in [0, 1), rounded up to whole
    steps; excludes ``warmup_steps``."""
    final_lr_ratio: _UnitRatio | None = None
    """For ``linear`` and ``cosine``: the learning rate reached at the end, as a fraction of the
    initial one, in [0, 1]; ``None`` means 0. Excludes ``final_lr``."""
    final_lr: NonNegativeFloat | None = None
    """For ``linear`` and ``cosine``: the learning rate reached at the end, absolute (nanoGPT's
    ``min_lr``), the same for every param group; excludes ``final_lr_ratio``."""
    decay_steps: PositiveInt | None = None
    """For ``linear`` and ``cosine``: the step count, from the run's start and warmup included,
    at which the decay reaches its floor, which then holds (nanoGPT's ``lr_decay_iters``);
    ``None``: ``max_steps``. It may be shorter or longer than the run."""

    @model_validator(mode="after")
    def _consistent(self) -> LrScheduleSettings:
        if self.warmup_steps is not None and self.warmup_ratio is not None:
            raise ValueError("give warmup_steps or warmup_ratio, not both")
        if self.name == "constant" and self.final_lr_ratio is not None:
            raise ValueError("final_lr_ratio applies to the linear and cosine schedules, not to constant")
        if self.name == "constant" and (self.final_lr is not None or self.decay_steps is not None):
            raise ValueError("final_lr and decay_steps apply to the linear and cosine schedules, not to constant")
        if self.final_lr is not None and self.final_lr_ratio is not None:
            raise ValueError("give final_lr or final_lr_ratio, not both")
        if self.decay_steps is not None and self.warmup_steps is not None and self.decay_steps <= self.warmup_steps:
            raise ValueError(
                f"decay_steps ({self.decay_steps}) must be greater than warmup_steps ({self.warmup_steps})"
            )
        return self

    def warmup_steps_for(self, max_steps: int) -> int:
        """The number of warmup steps in a run of ``max_steps`` steps."""
        if self.warmup_ratio is not None:
            return math.ceil(self.warmup_ratio * max_steps)
        return self.warmup_steps or 0

    def problems_in(self, max_steps: int | None, peak_lrs: Sequence[float]) -> list[str]:
        """What this schedule cannot do in a run of ``max_steps`` steps whose groups peak at ``peak_lrs``.

        ``warmup_ratio`` makes a warmup of the run's length, which may reach past ``decay_steps``
        (a warmup to the peak, then the floor in one step); an absolute ``final_lr`` above a
        group's peak would make the "decay" climb. ``max_steps`` ``None`` (bounded by epochs) or
        no ``peak_lrs``: that part is checked once they are known (``lr_factor``).
        """
        problems = []
        if max_steps is not None and self.warmup_ratio is not None and self.decay_steps is not None:
            warmup = self.warmup_steps_for(max_steps)
            if self.decay_steps <= warmup:
                problems.append(
                    f"decay_steps ({self.decay_steps}) must be greater than the warmup (warmup_ratio "
                    f"{self.warmup_ratio} of max_steps {max_steps}: {warmup} steps)"
                )
        if self.final_lr is not None:
            below = sorted({lr for lr in peak_lrs if lr < self.final_lr})
            if below:
                problems.append(
                    f"final_lr ({self.final_lr:g}) is above the peak learning rate "
                    f"({', '.join(f'{lr:g}' for lr in below)}): the decay would climb; give a final_lr at most the "
                    "peak, or final_lr_ratio"
                )
        return problems


def lr_factor(settings: LrScheduleSettings, max_steps: int, initial_lr: float | None = None) -> Callable[[int], float]:
    """The schedule as a function: completed steps -> multiplier of a group's initial lr.

    ``factor(k)`` is the learning rate of step ``k + 1`` over the initial one (see
    ``LrScheduleSettings``); past the decay it stays at the final value. A run shorter than its
    warmup is allowed (a smoke test of a long run's settings): it warms up and ends, with a
    warning.

    Args:
        settings: The schedule.
        max_steps: Optimizer steps in the run.
        initial_lr: The param group's initial lr; needed with ``final_lr``, an absolute floor.

    Raises:
        ValueError: ``max_steps`` is not a positive integer, ``final_lr`` is declared and
            ``initial_lr`` not given, or the schedule cannot run (``LrScheduleSettings.problems_in``).
    """
    if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1:
        raise ValueError(f"max_steps must be a positive integer, got {max_steps!r}")
    problems = settings.problems_in(max_steps, [] if initial_lr is None else [initial_lr])
    if problems:
        raise ValueError("\n".join(f"lr_schedule: {problem}" for problem in problems))
    warmup = settings.warmup_steps_for(max_steps)
    if warmup >= max_steps:
        warn_user(
            f"lr_schedule: the warmup of {warmup} steps is not shorter than the run ({max_steps} steps): the "
            f"learning rate only warms up, reaching {max_steps / (warmup + 1):.3g} x its peak at the last step",
            UserWarning,
        )
    end = settings.decay_steps if settings.decay_steps is not None else max_steps
    decay_steps = max(end - warmup, 1)
    final = settings.final_lr_ratio or 0.0
    if settings.final_lr is not None:
        if initial_lr is None:
            raise ValueError("lr_schedule final_lr is absolute: the param group's initial lr is needed")
        final = settings.final_lr / initial_lr if initial_lr else 0.0
    name = settings.name

    def factor(completed: int) -> float:
        if completed < warmup:
            return (completed + 1) / (warmup + 1)
        progress = min(completed - warmup, decay_steps) / decay_steps
        if name == "linear":
            return 1.0 - (1.0 - final) * progress
        if name == "cosine":
            return final + (1.0 - final) * (1.0 + math.cos(math.pi * progress)) / 2.0
        return 1.0

    return factor


def build_lr_scheduler(settings: LrScheduleSettings, optimizer: torch.optim.Optimizer, max_steps: int) -> LRScheduler:
    """Build the scheduler ``settings`` declare, to be stepped once after each optimizer step.

    A ``torch.optim.lr_scheduler.LambdaLR`` whose factor is the closed form of ``lr_factor``:
    each param group's own initial lr is scaled, so groups with different learning rates each
    warm up to their own lr and decay to their own ``final_lr_ratio`` of it. The factor is a
    function of the step count alone, and is not part of the scheduler's ``state_dict``: a run
    resumed with another ``max_steps`` follows the schedule of its own ``max_steps``.

    Args:
        settings: The schedule's settings.
        optimizer: The optimizer whose param groups' ``lr`` the schedule scales; its current
            ``lr`` (or ``initial_lr``, when a scheduler already set one) is the peak.
        max_steps: Optimizer steps in the run.

    Returns:
        The scheduler.

    Raises:
        ValueError: ``max_steps`` is not a positive integer.
    """
    if settings.final_lr is None:
        return LambdaLR(optimizer, lr_factor(settings, max_steps))
    # An absolute floor is a different ratio for each group's own lr: one factor per group.
    initial = [group.get("initial_lr", group["lr"]) for group in optimizer.param_groups]
    return LambdaLR(optimizer, [lr_factor(settings, max_steps, lr) for lr in initial])


def describe_schedule_change(saved: Mapping[str, Any], settings: Any, step: int) -> str | None:
    """What a declared schedule does when a run resumes with other ``max_steps`` or schedule.

    Args:
        saved: The checkpoint's settings, as JSON data.
        settings: This run's ``TrainerSettings``.
        step: The step the run resumes after.

    Returns:
        A sentence for the user, or ``None`` when nothing about the schedule changed (or none
        is declared now, or the run is bounded by ``max_epochs`` alone).
    """
    schedule = settings.lr_schedule
    if schedule is None or settings.max_steps is None or step >= settings.max_steps:
        return None
    then_steps, then_schedule = saved.get("max_steps"), saved.get("lr_schedule")
    if then_steps == settings.max_steps and then_schedule == schedule.model_dump(mode="json"):
        return None
    if schedule.final_lr is not None:  # the factor depends on each group's lr, unknown here
        return (
            f"lr_schedule: resuming after step {step} with max_steps {settings.max_steps} and lr_schedule "
            f"{schedule.model_dump(exclude_none=True)}, where the checkpoint's run had max_steps {then_steps} and "
            f"lr_schedule {then_schedule}: the schedule follows this run's settings from step {step + 2}."
        )
    now = lr_factor(schedule, settings.max_steps)
    shown_then = (
        {k: v for k, v in then_schedule.items() if v is not None} if isinstance(then_schedule, dict) else then_schedule
    )
    text = (
        f"lr_schedule: resuming after step {step} with max_steps {settings.max_steps} and lr_schedule "
        f"{schedule.model_dump(exclude_none=True)}, where the checkpoint's run had max_steps {then_steps} and "
        f"lr_schedule {shown_then}. The schedule is a function of the step and this run's settings: step "
        f"{step + 1} keeps the checkpoint's learning rate, then step {step + 2} runs at {now(step + 1):.4g} x "
        f"each group's initial lr"
    )
    if isinstance(then_steps, int):  # else that run was bounded by max_epochs alone
        try:
            then = lr_factor(LrScheduleSettings.model_validate(then_schedule), then_steps, 1.0)
            text += f" (the checkpoint's schedule had {then(step + 1):.4g} there)"
        except (ValueError, TypeError):  # no schedule then, or an unreadable one
            pass
    final = now(settings.max_steps)
    return text + f", and it reaches {final:.4g} x at step {settings.max_steps}."
