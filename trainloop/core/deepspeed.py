"""DeepSpeed as a strategy beside DDP and FSDP2: the engine started from the built model and optimizer, and driven.

With ``settings.deepspeed`` declared, ``building`` hands the plain model, its one optimizer and its lr scheduler
to ``deepspeed.initialize`` with the config trainloop filled (``trainloop.settings.deepspeed``); the engine
becomes ``trainer.model``, so ``forward`` calls ``self.model(x)`` as before. ``EngineStep`` then runs each step
in the same states as any other: ``accumulating`` calls the engine's backward on each microstep (DeepSpeed owns
the gradients' reduction across microsteps: nothing runs under ``no_sync``), ``stepping`` calls its step once
per update.

A non-finite update never reaches the weights, and is retried as any other (docs/machine.md): at ZeRO stage 0,
where DeepSpeed would write it into the weights, trainloop checks the gradients before the engine steps; at
stages 1 to 3 the engine skips it itself, and the step learns it from ``engine.skipped_steps``.

Under ``offload_optimizer`` the optimizer is DeepSpeed's CPU Adam (or a torch optimizer where the config says
``zero_force_ds_cpu_optimizer: false``); a resumed run brings the CPU Adam kernel to its loaded step as the
unbroken run had it (``continue_cpu_adam``). torch's deprecation warnings for the collectives DeepSpeed calls on
every microstep are left unsaid where DeepSpeed made the call (``quiet_torch_deprecations_in_deepspeed``).

DeepSpeed is imported only here and by the config's check (``trainloop.settings.deepspeed``), and only when a run
declares it.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import replace
from time import perf_counter
from types import FrameType
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from trainloop.core.result import RefusedRunError
from trainloop.core.step import (
    DeviceVerdict,
    Microstep,
    NonFiniteGradCheck,
    StepPlan,
    unpack_forward_output,
    update_plans,
)
from trainloop.distributed.ranks import world_size
from trainloop.settings.deepspeed import filled_config, micro_batch_problem, offload_device, read_config, zero_stage
from trainloop.utils import is_distributed_model

if TYPE_CHECKING:
    from trainloop.core.data import EpochIterator
    from trainloop.core.run_state import TrainerContract
    from trainloop.settings.model import TrainerSettings

__all__ = [
    "EXTRA", "LAUNCH_ENV", "TORCH_DEPRECATION", "EngineStep", "continue_cpu_adam", "deepspeed_missing",
    "engine_runners", "launch_problem", "not_installed", "one_optimizer", "quiet_torch_deprecations_in_deepspeed",
    "start_engine",
]

#: What installs DeepSpeed beside trainloop.
EXTRA = "trainloop[deepspeed]"


def deepspeed_missing() -> bool:
    """Whether DeepSpeed cannot be imported here (found without importing it)."""
    try:
        return importlib.util.find_spec("deepspeed") is None
    except (ImportError, ValueError):  # blocked in sys.modules, or a parent that fails to import
        return True


def not_installed() -> str:
    """The one line that refuses a run declaring ``deepspeed`` where DeepSpeed is not installed."""
    return (
        f"deepspeed: DeepSpeed is not installed; install it with pip install '{EXTRA}' "
        "(DS_BUILD_OPS=0 and --no-build-isolation, after torch: see the README)"
    )


def start_engine(
    settings: TrainerSettings,
    owner: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | Mapping[str, torch.optim.Optimizer],
    lr_scheduler: Any,
    data_loader: Iterable[Any],
    hooks: Iterable[Any] = (),
) -> Any:
    """The DeepSpeed engine of the built components, under the config ``settings.deepspeed`` declares, filled.

    Args:
        settings: The run's settings (``deepspeed`` set).
        owner: The trainer class's name, for the messages.
        model: What ``build_model()`` returned: the plain module on its device.
        optimizer: What ``build_optimizer()`` returned: one torch optimizer.
        lr_scheduler: What ``build_lr_scheduler()`` returned (the engine steps it after each applied update).
        data_loader: What ``build_data_loader()`` returned: its ``batch_size`` is the micro batch.
        hooks: The run's hooks: one that reads every parameter whole is refused at ZeRO stage 3.

    Raises:
        RefusedRunError: Several optimizers, a model wrapped in DDP/FSDP, a micro batch or a batch size that
            contradicts the data loader, DeepSpeed not installed: before step 1, one line.
    """
    assert settings.deepspeed is not None
    optimizer = one_optimizer(optimizer, owner)
    if is_distributed_model(model):
        raise RefusedRunError(
            f"{owner}.build_model() returned a model wrapped in {type(model).__name__}, but deepspeed wraps the "
            "plain module itself: return it unwrapped"
        )
    config = read_config(settings.deepspeed)
    accumulation = settings.gradient_accumulation_steps
    batch_size = getattr(data_loader, "batch_size", None)
    problems = [micro_batch_problem(config, batch_size, accumulation, world_size())]
    if zero_stage(config) == 3:
        problems += [
            f"{type(hook).__name__} reads the model's parameters whole, but deepspeed's ZeRO stage 3 leaves each "
            "rank only its partition: use a stage of 0 to 2 with it"
            for hook in hooks
            if getattr(hook, "reads_whole_parameters", False)
        ]
    if settings.max_epochs is not None and accumulation > 1:
        batches = _batches_per_epoch(data_loader)
        if batches is None or batches % accumulation:
            problems.append(
                f"deepspeed divides every microstep's loss by gradient_accumulation_steps={accumulation}, but "
                f"an epoch of {batches} batches ends on a shorter step (max_epochs): use max_steps, or an epoch "
                "whose batches the accumulation divides"
            )
    lines = [problem for problem in problems if problem is not None]
    if lines:
        raise RefusedRunError("\n".join(lines))
    filled = filled_config(
        config,
        accumulation=accumulation,
        grad_clip=settings.grad_clip,
        mixed_precision=settings.mixed_precision,
        batch_size=batch_size,
    )
    quiet_torch_deprecations_in_deepspeed()
    try:
        import deepspeed  # heavy: only for the runs that declare it
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        from deepspeed.ops.lion import DeepSpeedCPULion
    except ImportError:
        raise RefusedRunError(not_installed()) from None
    device = offload_device(config)
    forced = config.get("zero_force_ds_cpu_optimizer", True)
    if device is not None and forced and not isinstance(optimizer, (DeepSpeedCPUAdam, DeepSpeedCPULion)):
        raise RefusedRunError(
            f"{owner}.build_optimizer() returned {type(optimizer).__name__}, but deepspeed's offload_optimizer "
            f"(device {device!r}) steps DeepSpeed's CPU optimizer: return deepspeed.ops.adam.DeepSpeedCPUAdam, or "
            'set "zero_force_ds_cpu_optimizer": false to step this one on the CPU'
        )
    precision = settings.mixed_precision
    accelerator = deepspeed.get_accelerator()
    if precision in ("bf16", "fp16") and not getattr(accelerator, f"is_{precision}_supported")():
        raise RefusedRunError(
            f"mixed_precision is {precision!r}, which DeepSpeed's {accelerator.device_name()} accelerator does not "
            "support: declare another mixed_precision (or none)"
        )
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=lr_scheduler, config=filled)
    return engine


#: What torch 2.13 says, as a FutureWarning, at each call of a collective it deprecates (DeepSpeed 0.19.8 calls
#: ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` on every microstep at ZeRO stage 3).
TORCH_DEPRECATION = r"`torch\.distributed\.\w+` is deprecated"


class _CalledByDeepSpeed:
    """A warnings filter's module pattern that matches a warning of torch's deprecation wrapper that DeepSpeed caused.

    The wrapper attributes every warning to itself (``torch.distributed.c10d_logger``), whoever called: the caller
    is found on the stack, as the first frame outside torch and the warnings machinery.
    """

    def match(self, module: str) -> bool:
        if module != "torch.distributed.c10d_logger":
            return False
        frame: FrameType | None = sys._getframe(1)
        while frame is not None:
            name = str(frame.f_globals.get("__name__", ""))
            if name != "warnings" and not name.startswith(("torch.", "typing_extensions")):
                return name == "deepspeed" or name.startswith("deepspeed.")
            frame = frame.f_back
        return False


def quiet_torch_deprecations_in_deepspeed() -> None:
    """Leave unsaid torch's FutureWarnings about the deprecated collectives that DeepSpeed's own code calls.

    DeepSpeed's CPU accelerator runs a subprocess (``numactl``) on every microstep at ZeRO stage 3, which resets
    Python's record of the warnings already shown: each call's warning was printed again (124 lines in the docs'
    20-step example on 2 ranks). Only warnings whose call came from DeepSpeed's modules match; the same
    deprecation from the user's code or trainloop's is shown as ever. Installed once per process.
    """
    if any(isinstance(entry[3], _CalledByDeepSpeed) for entry in warnings.filters):
        return
    warnings.filterwarnings("ignore", TORCH_DEPRECATION, FutureWarning)
    action, message, category, _, lineno = warnings.filters[0]
    warnings.filters[0] = (action, message, category, _CalledByDeepSpeed(), lineno)  # type: ignore[index]


#: What DeepSpeed reads of a launcher's environment to join (or start) the process group; without it, it asks MPI.
LAUNCH_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")


def launch_problem() -> str | None:
    """What the process lacks that DeepSpeed needs of its launcher, or ``None``.

    DeepSpeed joins the process group from torchrun's environment (or the group already made, still reading
    ``LOCAL_RANK``); without it, it looks for MPI (``mpi4py``) and ends in a traceback. Under ``mpirun`` it finds MPI.
    """
    if "OMPI_COMM_WORLD_LOCAL_RANK" in os.environ:
        return None
    needed = ("LOCAL_RANK",) if torch.distributed.is_initialized() else LAUNCH_ENV
    missing = [name for name in needed if name not in os.environ]
    if not missing:
        return None
    return (
        f"deepspeed joins the process group a launcher describes, and this process has no {', '.join(missing)}: "
        "launch it with torchrun (torchrun --nproc-per-node 1 -m trainloop run ... for one process)"
    )


def one_optimizer(optimizer: torch.optim.Optimizer | Mapping[str, torch.optim.Optimizer], owner: str) -> Any:
    """``optimizer``, the one ``build_optimizer()`` returned; several are refused (checked as soon as it returns).

    Raises:
        RefusedRunError: Several optimizers, one line.
    """
    if isinstance(optimizer, Mapping):
        raise RefusedRunError(
            f"{owner}.build_optimizer() returned several optimizers ({', '.join(map(str, optimizer))}), "
            "but deepspeed drives one: return one optimizer"
        )
    return optimizer


def _batches_per_epoch(data_loader: Iterable[Any]) -> int | None:
    try:
        return len(data_loader)  # type: ignore[arg-type]
    except TypeError:
        return None


def engine_runners(
    engine: Any, trainer: TrainerContract, data: Iterator[Any], *, epochs: EpochIterator | None
) -> dict[str, EngineStep]:
    """The step's runner under DeepSpeed: the engine runs the update of the one optimizer (``start_engine`` checked).

    The plan's optimizer is the engine's (DeepSpeed's wrapper under ZeRO or bf16): the step zeroes the gradients
    through it, which clears the module's and leaves alone the buffers the engine keeps (under ``offload_optimizer``
    the optimizer's own parameters hold the engine's pinned gradient buffers, which its ``zero_grad`` would drop).
    """
    plans = update_plans(trainer, check_grads=trainer.settings.detect_non_finite_grads, by_name=False)
    continue_cpu_adam(getattr(engine, "basic_optimizer", None))
    return {
        name: EngineStep(engine, replace(plan, optimizer=engine.optimizer), data, epochs=epochs)
        for name, plan in plans.items()
    }


def continue_cpu_adam(optimizer: Any) -> None:
    """Bring DeepSpeed's CPU Adam (``offload_optimizer``) to the step its loaded state is at, as in the unbroken run.

    Its C++ kernel keeps ``beta1**t`` and ``beta2**t`` itself, multiplying them in step by step; a kernel made
    afresh meets a loaded step and computes them with ``pow``, which differs in the last bits, so a resumed run
    would drift from the unbroken one. Stepping the kernel through the earlier steps on no elements gives it the
    unbroken run's powers. Nothing for another optimizer or a run that starts at step 0.
    """
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    if not isinstance(optimizer, DeepSpeedCPUAdam):
        return
    steps = max((int(state["step"]) for state in optimizer.state.values() if "step" in state), default=0)
    nothing = torch.empty(0)
    for step in range(1, steps + 1):  # the calls each step made, on no elements
        for group in optimizer.param_groups:
            beta1, beta2 = group["betas"]
            optimizer.ds_opt_adam.adam_update(
                optimizer.opt_id, step, group["lr"], beta1, beta2, group["eps"], group["weight_decay"],
                group["bias_correction"], nothing, nothing, nothing, nothing,
            )


class EngineStep:
    """Runs the microsteps and the update of a step through a DeepSpeed engine (the loop's step runner under it).

    Each microstep tells the engine whether it ends the step's accumulation, then calls its backward on the
    plain loss (the engine divides it by the accumulation); the update calls the engine's step once, which
    clips, steps the optimizer and the lr scheduler, and zeroes the gradients. ``Step`` drives it as it drives
    a ``StepRunner`` (``UpdateRunner``).

    Args:
        engine: The engine ``start_engine`` made.
        plan: The optimizer's plan (its forward, owner, accumulation and checks; the engine owns the rest).
        data: The batches.
        epochs: ``data`` itself under ``max_epochs`` (the engine's accumulation divides every epoch, checked).
    """

    def __init__(self, engine: Any, plan: StepPlan, data: Iterator[Any], epochs: EpochIterator | None = None) -> None:
        self.engine = engine
        self.verdict: DeviceVerdict | None = None  # the engine's step decides on the host: none travels on the device
        self.plan = plan
        self.data = data
        self.epochs = epochs
        self.microsteps = 0
        self.target = plan.accumulation
        self.grad_norm: torch.Tensor | None = None
        self.stage = zero_stage(engine.config)
        # Stage 0 applies what the gradients hold: trainloop checks them first (one host sync, as for any optimizer
        # that cannot skip on the device). Stages 1 to 3 check and skip in the engine.
        check = plan.check_grads and self.stage == 0
        self._check = NonFiniteGradCheck(engine.module.parameters()) if check else None

    def begin(self, fresh: bool = True) -> None:
        """Start a step, or its retry: no microstep done."""
        self.microsteps = 0

    def microsteps_remain(self) -> bool:
        """Whether the step needs another microstep (the accumulation's count)."""
        return self.microsteps < self.target

    def microstep(self) -> Microstep:
        """Draw batches until ``forward`` returns a loss, and hand it to the engine's backward.

        Raises:
            TypeError: ``forward`` returned a ``Loss`` (the engine divides a plain loss by the accumulation) or
                something else than a scalar tensor.
        """
        plan, engine = self.plan, self.engine
        engine.set_gradient_accumulation_boundary(self.microsteps + 1 >= self.target)
        data_time = 0.0
        while True:
            start = perf_counter()
            batch = next(self.data)
            data_time += perf_counter() - start
            loss, records = unpack_forward_output(plan.forward(batch), plan.owner)
            if loss is not None:
                break
        if not isinstance(loss, torch.Tensor) or loss.ndim:
            got = type(loss).__name__ if not isinstance(loss, torch.Tensor) else f"shape {tuple(loss.shape)}"
            raise TypeError(
                f"{plan.owner} must return a scalar tensor loss under deepspeed (got {got}): the engine divides "
                "it by the accumulation itself"
            )
        engine.backward(loss)
        self.microsteps += 1
        return Microstep(loss, records, data_time)

    def prepare(self) -> None:
        """Nothing: the engine unscales and reduces the gradients in its step."""

    def apply(self) -> bool:
        """The engine's step, unless the gradients are non-finite.

        Returns:
            ``True`` if the update was applied; ``False`` if it was not, the gradients non-finite: at stage 0
            found before the engine stepped, at stages 1 to 3 skipped by the engine (``skipped_steps`` went up).
            Either way the gradients are gone or zeroed by the retry.
        """
        engine = self.engine
        if self._check is not None and self._check():
            engine.zero_grad()
            return False
        skipped = engine.skipped_steps
        engine.step()
        if self.plan.grad_clip is not None:
            norm = engine.get_global_grad_norm()
            self.grad_norm = torch.as_tensor(float("nan") if norm is None else float(norm))
        return bool(engine.skipped_steps == skipped)
