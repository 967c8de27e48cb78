"""The DeepSpeed worker's cases of the config: offload, and the warnings a run prints.

``cases(root)`` runs inside tests/support/deepspeed_worker.py's one ``torchrun`` launch and returns its results
under their names. Offload holds the optimizer states (and at stage 3 the parameters) on the CPU: each case
trains through a trainer and through the hand-written DeepSpeed loop with the same config and optimizer, as the
worker's other cases do, and stops and resumes. DeepSpeed wants its own CPU Adam under offload
(``DeepSpeedCPUAdam``, a C++ extension built on first use); a torch optimizer runs there only with
``"zero_force_ds_cpu_optimizer": false``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import deepspeed
import deepspeed_worker as worker  # its names read when called: it imports this module first
import torch
import torch.distributed as dist
from deepspeed.ops.adam import DeepSpeedCPUAdam
from torch import nn

from trainloop import BaseHook, CheckpointingHook, seed_all
from trainloop.settings.deepspeed import filled_config

Optimizer = Callable[[nn.Module], torch.optim.Optimizer]


def cpu_adam(module: nn.Module) -> torch.optim.Optimizer:
    return DeepSpeedCPUAdam(module.parameters(), lr=1e-2, adamw_mode=True)


def torch_adamw(module: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(module.parameters(), lr=1e-2)


OFFLOAD = {"device": "cpu"}
CASES: dict[str, tuple[dict[str, Any], Optimizer]] = {
    "offload_stage2_cpu_adam": ({"zero_optimization": {"stage": 2, "offload_optimizer": OFFLOAD}}, cpu_adam),
    "offload_stage3_cpu_adam": (
        {"zero_optimization": {"stage": 3, "offload_optimizer": OFFLOAD, "offload_param": OFFLOAD}}, cpu_adam
    ),
    "offload_stage2_torch_adamw": (
        {"zero_optimization": {"stage": 2, "offload_optimizer": OFFLOAD}, "zero_force_ds_cpu_optimizer": False},
        torch_adamw,
    ),
}


def trainer(config: dict[str, Any], build: Optimizer, steps: int, **settings: Any) -> worker.DeepSpeedTrainer:
    made = worker.DeepSpeedTrainer(
        max_steps=steps, seed=0, device="cpu", deepspeed=config, metrics_file=False, **settings
    )
    made.build_optimizer = lambda: build(made.model)  # type: ignore[method-assign]
    return made


def with_trainloop(config: dict[str, Any], build: Optimizer) -> list[float]:
    losses = worker.Losses()
    run = trainer(config, build, worker.STEPS)
    run.build_hooks = lambda: [losses]  # type: ignore[method-assign]
    run.train()
    run.loop.engine.destroy()
    return losses.losses


def by_hand(config: dict[str, Any], build: Optimizer) -> list[float]:
    seed_all(0)
    batches = worker.loader()
    module = worker.model()
    filled = filled_config(config, accumulation=1, grad_clip=None, mixed_precision=None, batch_size=worker.BATCH)
    engine, *_ = deepspeed.initialize(model=module, optimizer=build(module), config=filled)
    losses = []
    data = iter(batches)
    for _ in range(worker.STEPS):
        loss = worker.loss_of(engine, next(data))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.destroy()
    return losses


def resumed(config: dict[str, Any], build: Optimizer, workspace: Path) -> list[float]:
    """Two steps saved at each, then a resume to step 4: the losses of steps 3 and 4."""

    def run(steps: int, *hooks: BaseHook) -> worker.DeepSpeedTrainer:
        made = trainer(config, build, steps, workspace=workspace)
        made.build_hooks = lambda: [CheckpointingHook(interval=1, keep_previous=1), *hooks]  # type: ignore[method-assign]
        made.train()
        made.loop.engine.destroy()
        return made

    run(2)
    losses = worker.Losses()
    run(4, losses)
    return losses.losses


def future_warnings() -> dict[str, int]:
    """The FutureWarnings a ZeRO-3 run of 4 steps x 2 microsteps shows: all, and those of forward's collective.

    DeepSpeed calls that collective too, with the same message. Every warning is shown, none deduplicated (``always``, after the filters a run installs).
    """

    class GatheringTrainer(worker.DeepSpeedTrainer):
        """Its ``forward`` also calls a collective torch deprecates, as user code may."""

        def forward(self, batch: Any) -> tuple[torch.Tensor, dict[str, Any]]:
            x = batch[0]
            dist.all_gather_into_tensor(torch.empty(2 * x.numel()), x.flatten().contiguous())
            return super().forward(batch)

    config = {"zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True}
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always", append=True)
        run = GatheringTrainer(
            max_steps=worker.STEPS, seed=0, device="cpu", deepspeed=config, gradient_accumulation_steps=2,
            metrics_file=False,
        )
        run.train()
        run.loop.engine.destroy()
    future = [str(w.message) for w in shown if issubclass(w.category, FutureWarning)]
    ours = "`torch.distributed.all_gather_into_tensor` is deprecated"
    return {"all_gather_into_tensor": sum(ours in text for text in future), "all": len(future)}


def cases(root: Path) -> dict[str, Any]:
    """Every case's results: ``{"trainloop": [...], "by_hand": [...], "resumed": [...]}`` per offload case, and
    ``future_warnings``."""
    results: dict[str, Any] = {
        name: {
            "trainloop": with_trainloop(config, build),
            "by_hand": by_hand(config, build),
            "resumed": resumed(config, build, root / name),
        }
        for name, (config, build) in CASES.items()
    }
    results["future_warnings"] = future_warnings()
    return results
