"""Run under ``torchrun --nproc-per-node 2`` with ``DS_ACCELERATOR=cpu``: every DeepSpeed case of the tests in one launch.

Each case trains the same model on the same data twice, once through a trainer whose settings declare ``deepspeed``
and once through the hand-written DeepSpeed loop (``engine(x)``, ``engine.backward(loss)``, ``engine.step()``), and
records both runs' per-microstep losses. Rank 0 writes ``{case: {"trainloop": [...], "by_hand": [...]}}`` to the
JSON file named by the first argument. One launch pays DeepSpeed's import and set-up once for every case.

The resume cases (``RESUMES``) run a trainer unbroken, stopped after a step's save, and resumed from it, and compare
the two ends entry by entry (``end_state``): the engine's weights, optimizer partitions, lr scheduler and counters,
trainloop's state, the generators and every forward's items. Each rank's differences are written (none: exact).
"""

from __future__ import annotations

import copy
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import deepspeed
import deepspeed_config_cases
import torch
import torch.distributed as dist
from resume_matrix import engine_state, same
from resume_matrix import flatten as flat
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from trainloop import BaseHook, BaseTrainer, CheckpointError, CheckpointingHook, EmaHook, seed_all
from trainloop.checkpoint.manifest import hash_file
from trainloop.distributed import rank, world_size
from trainloop.hooks import LoggingHook, ProfilerHook, ProgressHook
from trainloop.settings.deepspeed import filled_config

STEPS = 4
BATCH = 4
NAN_AT = -1  # the step whose first try gets a NaN loss (none but in non_finite)


def dataset() -> TensorDataset:
    """64 items ``(x, y, index)``: the index says which item a forward drew."""
    generator = torch.Generator().manual_seed(1234)
    x = torch.randn(64, 8, generator=generator)
    return TensorDataset(x, x.sum(dim=1, keepdim=True).sin(), torch.arange(64))


def loader() -> DataLoader[Any]:
    data = dataset()
    return DataLoader(data, batch_size=BATCH, sampler=DistributedSampler(data, shuffle=False))


def model(dropout: float = 0.0) -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(dropout), nn.Linear(16, 1))


def optimizer(module: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(module.parameters(), lr=1e-2)


def loss_of(engine: Any, batch: Any) -> torch.Tensor:
    x, y, _ = batch
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


@dataclass(frozen=True)
class Resume:
    """A run stopped after ``stop`` (saved there) and resumed to ``steps``, against the same run unbroken."""

    stage: int
    accumulation: int
    precision: str | None
    stop: int
    steps: int
    ema: bool
    nan_at: int  # a step before the stop whose first try is non-finite: the guard's retry crosses the resume
    offload: bool = False  # the optimizer states on the CPU, stepped by DeepSpeed's CPU Adam

    def config(self) -> dict[str, Any]:
        zero: dict[str, Any] = {"stage": self.stage}
        if self.offload:
            zero["offload_optimizer"] = {"device": "cpu"}
        return {"zero_optimization": zero, "zero_allow_untested_optimizer": True}


#: A covering few: every stage; a stop mid-epoch and at an epoch's last step (8 microsteps an epoch on 2 ranks);
#: accumulation 1 and 2; fp32 and bf16; EMA where allowed (stages 0 to 2); a retried update before every stop.
RESUMES = {
    "resume_stage0": Resume(stage=0, accumulation=1, precision=None, stop=3, steps=10, ema=True, nan_at=2),
    "resume_stage1": Resume(stage=1, accumulation=2, precision="bf16", stop=4, steps=6, ema=True, nan_at=2),
    "resume_stage2": Resume(stage=2, accumulation=2, precision=None, stop=3, steps=6, ema=True, nan_at=2),
    "resume_stage3": Resume(stage=3, accumulation=1, precision="bf16", stop=8, steps=10, ema=False, nan_at=5),
    "resume_stage2_offload": Resume(stage=2, accumulation=1, precision=None, stop=3, steps=6, ema=True, nan_at=2,
                                    offload=True),
}


#: Each case's unbroken run's end state, by case (the corrupt case shares one).
UNBROKEN: dict[Resume, dict[str, Any]] = {}


class Stopped(Exception):
    """Ends a run on every rank right after its stop step's save, as a preemption would."""


class ResumeTrainer(DeepSpeedTrainer):
    """Dropout (torch's generator at every forward), a shuffled sampler whose epoch trainloop sets, an lr schedule.

    Records every forward's step, items and loss in ``draws``; the first try of ``nan_at`` is non-finite.
    """

    nan_at = -1

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.draws: list[tuple[int, list[int], float]] = []

    def build_data_loader(self) -> DataLoader[Any]:
        data = dataset()  # the ranks named: the command line builds it before DeepSpeed starts the process group
        sampler = DistributedSampler(data, num_replicas=world_size(), rank=rank(), shuffle=True, seed=3)
        return DataLoader(data, batch_size=BATCH, sampler=sampler)

    def build_model(self) -> nn.Module:
        return model(dropout=0.2)

    def forward(self, batch: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        loss = loss_of(self.model, batch)
        if self.step == self.nan_at and self.step_info.non_finite_grad_retries == 0:
            loss = loss * float("nan")
        self.draws.append((self.step, batch[2].tolist(), loss.item()))
        return loss, {}


def end_state(trainer: ResumeTrainer, hooks: list[BaseHook]) -> dict[str, Any]:
    """Everything a run ends with on this rank: the engine's module (whole, gathered at ZeRO-3), optimizer (its
    partitions and fp32 master weights), lr scheduler and counters; trainloop's state (step, epoch, every rank's
    generators and data position, the guard's verdicts, the hooks': EMA); torch's generator; the draws."""
    ema = [hook for hook in hooks if isinstance(hook, EmaHook)]
    state = trainer.state_dict()
    del state["training_state"]["settings"]  # the declaration, workspace included (a resume compares it itself)
    return {
        **engine_state(trainer.loop.engine),
        "trainloop": state,
        "ema": ema[0].ema_model.state_dict() if ema else {},  # type: ignore[union-attr]
        "rng": torch.get_rng_state(),
        "draws": trainer.draws,
    }


def resume_run(case: Resume, workspace: Path, run: str, interval: int = 0) -> tuple[ResumeTrainer, list[BaseHook]]:
    """One run of ``case`` (see ``resume_trainer``), trained."""
    trainer, hooks = resume_trainer(case, workspace, run, interval)
    try:
        trainer.train()
    except Stopped:
        pass
    return trainer, hooks


def resume_trainer(
    case: Resume, workspace: Path, run: str, interval: int = 0
) -> tuple[ResumeTrainer, list[BaseHook]]:
    """A trainer of ``case``, saving every ``interval`` steps (the stop step's by default), for a run
    ``"unbroken"``, ``"stopped"`` (ended by ``Stopped`` after the stop step's save) or ``"resumed"`` (from
    ``latest``), and its hooks."""
    hooks: list[BaseHook] = [CheckpointingHook(interval=interval or case.stop, keep_previous=1)]
    if case.ema:
        hooks.append(EmaHook(decay=0.9))
    trainer = ResumeTrainer(
        max_steps=case.steps, seed=0, device="cpu", deepspeed=case.config(), workspace=workspace,
        gradient_accumulation_steps=case.accumulation, mixed_precision=case.precision, metrics_file=False,
        max_non_finite_grad_retries=1, lr_schedule={"name": "cosine", "warmup_steps": 2, "decay_steps": case.steps},
    )
    trainer.nan_at = case.nan_at
    trainer.build_hooks = lambda: hooks  # type: ignore[method-assign]
    if case.offload:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        trainer.build_optimizer = lambda: DeepSpeedCPUAdam(  # type: ignore[method-assign]
            trainer.model.parameters(), lr=1e-2, adamw_mode=True
        )
    if run == "stopped":

        def stop(trainer: ResumeTrainer) -> None:
            if trainer.step == case.stop:
                raise Stopped

        trainer.on_exit("checkpointing", stop)
    return trainer, hooks


def flatten(state: dict[str, Any]) -> dict[str, Any]:
    """An end state as ``{"a.b.0": leaf}``, every tensor copied (the engine's own may change after)."""
    return {key: value.detach().clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)
            for key, value in flat(state).items()}


def differences(got_flat: dict[str, Any], want_flat: dict[str, Any]) -> list[str]:
    """The entries of two flattened end states that are not bitwise equal (tensors: dtype, shape and values)."""
    differ = [key for key in want_flat if key not in got_flat or not same(got_flat[key], want_flat[key])]
    return differ + [key for key in got_flat if key not in want_flat]


def resumed(name: str, case: Resume, root: Path, corrupt: bool = False) -> dict[str, Any]:
    """``case`` stopped and resumed against its unbroken run: where their end states differ, on every rank.

    ``corrupt``: saves at every step, and one byte of rank 1's optimizer partition of the stop step is flipped
    (the file's size kept), so the resume must find it by the manifest and take the step before's checkpoint.
    """
    workspace = root / name
    unbroken = UNBROKEN.get(case)
    if unbroken is None:
        trainer, hooks = resume_run(case, root / f"{name}_unbroken", "unbroken")
        unbroken = UNBROKEN[case] = flatten(end_state(trainer, hooks))
        trainer.loop.engine.destroy()
    stopped, _ = resume_run(case, workspace, "stopped", interval=1 if corrupt else 0)
    stopped_draws = [draw for draw in stopped.draws if draw[0] <= case.stop]
    stopped.loop.engine.destroy()
    checkpoint = workspace / "checkpoints" / str(case.stop)
    files = sorted(p.relative_to(checkpoint).as_posix() for p in checkpoint.rglob("*") if p.is_file())
    if corrupt and dist.get_rank() == 0:
        partition = next((checkpoint / "deepspeed" / "engine").glob("*zero_pp_rank_1_*optim_states.pt"))
        data = bytearray(partition.read_bytes())
        data[len(data) // 2] ^= 0xFF
        partition.write_bytes(bytes(data))
    dist.barrier()
    trainer, hooks = resume_run(case, workspace, "resumed")
    first = trainer.draws[0][0]
    trainer.draws[:0] = [draw for draw in stopped_draws if draw[0] < first]
    state = flatten(end_state(trainer, hooks))
    if dist.get_rank() == 0:  # the run's weights, to hold its export to
        torch.save({k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")},
                   workspace / "module.pt")
    trainer.loop.engine.destroy()
    found: list[list[str]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(found, differences(state, unbroken))
    return {
        "differ": found, "compared": sorted(unbroken), "resumed_from": first - 1, "files": files,
        "kept": sorted(p.name for p in (workspace / "checkpoints").iterdir()), "engine": {key: value for key, value in unbroken.items() if key.startswith("engine.")},
        "retried": sorted({unbroken[key[:-1] + "0"] for key, loss in unbroken.items()
                           if key.startswith("draws.") and key.endswith(".2") and loss != loss}),
    }


def refused(case: Resume, workspace: Path) -> dict[str, Any]:
    """A resume of ``workspace``'s checkpoints by a run of ``case`` (another stage or precision): its error and exit
    code, whether the checkpoints are as they were (names, sizes, modification times) and runs.jsonl too."""
    def listing() -> list[tuple[str, int, int]]:
        return sorted((p.relative_to(workspace).as_posix(), p.stat().st_size, p.stat().st_mtime_ns)
                      for p in (workspace / "checkpoints").rglob("*"))

    def runs() -> str:
        return (workspace / "runs.jsonl").read_text() if (workspace / "runs.jsonl").exists() else ""

    before, recorded = listing(), runs()
    trainer, _ = resume_trainer(case, workspace, "resumed")
    error, exit_code = None, None
    try:
        trainer.train()
    except CheckpointError as refusal:
        error, exit_code = str(refusal), getattr(refusal, "exit_code", None)
    trainer.loop.engine.destroy()
    return {"error": error, "exit_code": exit_code, "untouched": listing() == before, "unrecorded": runs() == recorded}


def written_before_the_layout(case: Resume, workspace: Path) -> dict[str, Any]:
    """A resume of ``workspace``'s last checkpoint with ``metadata.json`` as written before it recorded the engine's
    layout (the manifest rewritten to match): whether it loaded, and the step it resumed at."""
    checkpoint = workspace / "checkpoints" / str(case.steps)
    if dist.get_rank() == 0:
        metadata = json.loads((checkpoint / "metadata.json").read_text())
        del metadata["deepspeed"]
        (checkpoint / "metadata.json").write_text(json.dumps(metadata))
        manifest = json.loads((checkpoint / "manifest.json").read_text())
        digest = hash_file(checkpoint / "metadata.json")
        manifest["files"]["metadata.json"] = {"size": digest.size, digest.checksum: digest.hex}
        (checkpoint / "manifest.json").write_text(json.dumps(manifest))
    dist.barrier()
    trainer, _ = resume_run(case, workspace, "resumed")  # the run is complete: it loads, and trains nothing
    trainer.loop.engine.destroy()
    return {"step": trainer.step, "global_steps": trainer.loop.engine.global_steps}


def machine_hooks() -> list[BaseHook]:
    """What shows a run: a save every 2 steps, the metrics with their throughput and the progress bar every 2 steps,
    the profiler over steps 1 and 2."""
    return [CheckpointingHook(interval=2, keep_previous=1), LoggingHook(interval=2, items="items"),
            ProgressHook(interval=2), ProfilerHook(wait=0, warmup=0, active=2, repeat=1)]


class ShownTrainer(ResumeTrainer):
    """ResumeTrainer that logs the items each microstep trained on (the throughput counts them)."""

    def forward(self, batch: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        loss, _ = super().forward(batch)
        return loss, {"items": len(batch[0])}


def machine_case(deepspeed_config: dict[str, Any] | None, workspace: Path) -> ShownTrainer:
    """A run of 4 steps of 2 microsteps, traced, with ``machine_hooks``; under ``deepspeed_config`` where given."""
    trainer = ShownTrainer(
        max_steps=4, seed=0, device="cpu", deepspeed=deepspeed_config, workspace=workspace, trace=True,
        gradient_accumulation_steps=2,
    )
    trainer.build_hooks = machine_hooks  # type: ignore[method-assign]
    return trainer


def machine_shows(root: Path) -> dict[str, Any]:
    """A ZeRO-2 run of ``machine_case``: the states it went through (rank 0's trace), the profiler's files."""
    workspace = root / "machine"
    trainer = machine_case({"zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True}, workspace)
    trainer.train()
    trainer.loop.engine.destroy()
    profiles = sorted(p.relative_to(workspace).as_posix() for p in (workspace / "profiles").rglob("*") if p.is_file())
    return {"workspace": str(workspace), "profiles": profiles if dist.get_rank() == 0 else []}


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
    for name, case in RESUMES.items():
        results[name] = resumed(name, case, root)
    results["corrupt_stage2"] = resumed("corrupt_stage2", RESUMES["resume_stage2"], root, corrupt=True)
    stage2, stage0 = RESUMES["resume_stage2"], RESUMES["resume_stage0"]
    results["refused_stage3"] = refused(replace(stage2, stage=3, ema=False), root / "resume_stage2")
    results["refused_bf16"] = refused(replace(stage2, precision="bf16"), root / "resume_stage2")
    results["refused_stage1"] = refused(replace(stage0, stage=1), root / "resume_stage0")
    results["older_stage2"] = written_before_the_layout(stage2, root / "resume_stage2")
    results.update(deepspeed_config_cases.cases(root))
    results["machine"] = machine_shows(root)
    if dist.get_rank() == 0:
        with open(out, "w", encoding="utf-8") as file:
            json.dump(results, file)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
