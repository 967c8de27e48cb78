"""Run under ``torchrun --nproc-per-node 2`` with ``DS_ACCELERATOR=cpu``: every DeepSpeed case of the tests in one launch.

Each case trains the same model on the same data twice, once through a trainer whose settings declare ``deepspeed``
and once through the hand-written DeepSpeed loop (``engine(x)``, ``engine.backward(loss)``, ``engine.step()``), and
records both runs' per-microstep losses. Rank 0 writes ``{case: {"trainloop": [...], "by_hand": [...]}}`` to the
JSON file named by the first argument. One launch pays DeepSpeed's import and set-up once for every case.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import deepspeed
import deepspeed_config_cases
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from trainloop import BaseHook, BaseTrainer, CheckpointingHook, seed_all
from trainloop.settings.deepspeed import filled_config

STEPS = 4
BATCH = 4
NAN_AT = -1  # the step whose first try gets a NaN loss (none but in non_finite)


def dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(1234)
    x = torch.randn(64, 8, generator=generator)
    return TensorDataset(x, x.sum(dim=1, keepdim=True).sin())


def loader() -> DataLoader[Any]:
    data = dataset()
    return DataLoader(data, batch_size=BATCH, sampler=DistributedSampler(data, shuffle=False))


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def optimizer(module: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(module.parameters(), lr=1e-2)


def loss_of(engine: Any, batch: Any) -> torch.Tensor:
    x, y = batch
    dtype = next(engine.parameters()).dtype  # bf16: DeepSpeed casts the module, not its inputs
    return nn.functional.mse_loss(engine(x.to(dtype)).float(), y)


class Losses(BaseHook):
    """Every microstep's loss, in order."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_after_step(self, trainer: Any) -> None:
        self.losses += [loss.item() for loss in trainer.step_info.loss]


class Retries(BaseHook):
    """The retries each step took, and its losses' finiteness."""

    def __init__(self) -> None:
        self.retries: list[int] = []
        self.finite: list[bool] = []

    def on_after_step(self, trainer: Any) -> None:
        self.retries.append(trainer.step_info.non_finite_grad_retries)
        self.finite.append(all(bool(loss.isfinite()) for loss in trainer.step_info.loss))


class DeepSpeedTrainer(BaseTrainer):
    def build_data_loader(self) -> DataLoader[Any]:
        return loader()

    def build_model(self) -> nn.Module:
        return model()

    def build_optimizer(self) -> torch.optim.Optimizer:
        return optimizer(self.model)

    def forward(self, batch: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        loss = loss_of(self.model, batch)
        if self.step == NAN_AT and self.step_info.non_finite_grad_retries == 0:
            loss = loss * float("nan")  # the first try of this step only: its retry trains on
        return loss, {}


def with_trainloop(config: dict[str, Any], accumulation: int, precision: str | None = None) -> list[float]:
    losses = Losses()
    trainer = DeepSpeedTrainer(
        max_steps=STEPS, seed=0, device="cpu", deepspeed=config, gradient_accumulation_steps=accumulation,
        mixed_precision=precision, metrics_file=False,
    )
    trainer.build_hooks = lambda: [losses]  # type: ignore[method-assign]
    trainer.train()
    trainer.loop.engine.destroy()
    return losses.losses


def by_hand(config: dict[str, Any], accumulation: int, precision: str | None = None) -> list[float]:
    seed_all(0)
    batches = loader()
    module = model()
    filled = filled_config(
        config, accumulation=accumulation, grad_clip=None, mixed_precision=precision, batch_size=BATCH
    )
    engine, *_ = deepspeed.initialize(model=module, optimizer=optimizer(module), config=filled)
    losses = []
    data = iter(batches)
    for _ in range(STEPS * accumulation):
        loss = loss_of(engine, next(data))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.destroy()
    return losses


def non_finite(config: dict[str, Any]) -> dict[str, Any]:
    """A NaN loss on step 2's first try: the step retried, no NaN in the weights (every later loss finite)."""
    global NAN_AT
    NAN_AT = 2
    hook = Retries()
    trainer = DeepSpeedTrainer(
        max_steps=STEPS, seed=0, device="cpu", deepspeed=config, max_non_finite_grad_retries=1, metrics_file=False,
        trace=True,
    )
    trainer.build_hooks = lambda: [hook]  # type: ignore[method-assign]
    try:
        trainer.train()
    finally:
        NAN_AT = -1
    trainer.loop.engine.destroy()
    return {"retries": hook.retries, "finite": hook.finite, "skipped_steps": trainer.loop.engine.skipped_steps}


def resumed(config: dict[str, Any], workspace: Path, corrupt: bool = False) -> dict[str, Any]:
    """Two steps saved at each, then a resume to step 4: its losses, and what the checkpoint holds.

    ``corrupt``: one byte of rank 1's optimizer partition of step 2 flipped first (the file's size kept), so the
    resume must find it by the manifest and take step 1's checkpoint.
    """
    def trainer(steps: int, *hooks: BaseHook) -> DeepSpeedTrainer:
        made = DeepSpeedTrainer(
            max_steps=steps, seed=0, device="cpu", deepspeed=config, workspace=workspace, metrics_file=False
        )
        made.build_hooks = lambda: [CheckpointingHook(interval=1, keep_previous=1), *hooks]  # type: ignore[method-assign]
        return made

    first = trainer(2)
    first.train()
    first.loop.engine.destroy()
    checkpoint = workspace / "checkpoints" / "2"
    files = sorted(p.relative_to(checkpoint).as_posix() for p in checkpoint.rglob("*") if p.is_file())
    if corrupt and dist.get_rank() == 0:
        partition = next((checkpoint / "deepspeed" / "engine").glob("*zero_pp_rank_1_*optim_states.pt"))
        data = bytearray(partition.read_bytes())
        data[len(data) // 2] ^= 0xFF
        partition.write_bytes(bytes(data))
    dist.barrier()
    losses = Losses()
    second = trainer(4, losses)
    second.train()
    second.loop.engine.destroy()
    return {"losses": losses.losses, "files": files, "kept": sorted(p.name for p in (workspace / "checkpoints").iterdir())}


CASES = {
    f"stage{stage}_acc{accumulation}": ({"zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True},
                                        accumulation)
    for stage in (0, 1, 2, 3) for accumulation in (1, 2)
}
PRECISIONS = {f"stage{stage}_bf16": CASES[f"stage{stage}_acc1"][0] for stage in (0, 1, 2, 3)}


def main(out: str) -> None:
    root = Path(out).parent
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    results = {}
    for name, (config, accumulation) in CASES.items():
        results[name] = {"trainloop": with_trainloop(config, accumulation), "by_hand": by_hand(config, accumulation)}
    for name, config in PRECISIONS.items():
        results[name] = {"trainloop": with_trainloop(config, 1, "bf16"), "by_hand": by_hand(config, 1, "bf16")}
    for stage in (0, 1, 2, 3):
        config = {"zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True}
        results[f"non_finite_stage{stage}"] = non_finite(config)
        results[f"resumed_stage{stage}"] = resumed(config, root / f"resumed_stage{stage}")
    results["corrupt_stage2"] = resumed(CASES["stage2_acc1"][0], root / "corrupt_stage2", corrupt=True)
    results.update(deepspeed_config_cases.cases(root))
    if dist.get_rank() == 0:
        with open(out, "w", encoding="utf-8") as file:
            json.dump(results, file)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
