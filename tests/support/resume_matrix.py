"""The resume matrix's harness: one declaration run unbroken, and stopped at a point then resumed
from its checkpoint, compared sample for sample and tensor for tensor.

A :class:`Case` is one point of the product of features (optimizers, checkpoint format, storage,
stop point, accumulation, loss, precision, EMA, schedule, run length, a non-finite update just
after the resume point, ranks). :func:`train` runs it ``"unbroken"``; ``"stopped"``, until the
stop step, whose checkpoint the hook's interval saves (then one process asks to exit, several
ranks end as if preempted; a ``"signal"`` stop is the script's, below); or ``"resumed"`` from that
checkpoint to the end. Every run records which items each forward drew (with the step and the
optimizer it was for), and ends with its final state: model, optimizers, schedulers, grad
scaler, EMA and torch's generator. :func:`divergences` lists where a stopped-then-resumed run
differs from the unbroken one.

Also a script, for the stops that need a real process (needs ``tests/support`` and the
repository root on ``PYTHONPATH``)::

    python resume_matrix.py '<JSON list of jobs>'
    python resume_matrix.py serve        # one JSON job per stdin line, as they come

Each job is ``{"case": {...}, "root": ..., "run": "unbroken" | "stopped" | "resumed", "record":
..., "s3": ...}`` (the :func:`train` arguments; the record goes to ``<record>.rank<r>.pt``) or
``{"join": {"rank": r, "world": w, "port": p}}``, which joins a gloo group of ``w`` ranks). A
``stopped`` run of a case whose stop is ``"signal"`` blocks in ``forward`` at the stop step's
second-to-last microstep (its only one without accumulation), after printing ``paused <case
id>``, until a line arrives on stdin: the parent sends SIGTERM meanwhile, so the signal lands
mid-accumulation. Each job ends with
``<rank> done <case id> <run> <exit code>``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from trainloop import BaseHook, BaseTrainer, Loss
from trainloop.hooks.checkpointing import CheckpointingHook
from trainloop.hooks.ema import EmaHook

SEED = 11
ITEMS = 36
BATCH = 4  # a microstep's items over all ranks: 9 microsteps per epoch
NAN = float("nan")

#: Every axis and its values, the first of each the default. ``zero1`` and ``zero3`` are DeepSpeed at that ZeRO
#: stage (``settings.deepspeed``; the checkpoint is the engine's, whatever the hook's format), which takes part only
#: where :func:`deepspeed_refuses` finds nothing: one optimizer, not fused, a mean loss, fp32 or bf16, local storage,
#: no signal stop, EMA below stage 3, and 2 ranks resumed on 2 (the children have a process group for the engine).
AXES: dict[str, tuple[Any, ...]] = {
    "optimizers": ("one", "several", "fused"),
    "format": ("full", "sharded", "full_async", "sharded_async", "zero1", "zero3"),
    "storage": ("local", "memory", "s3"),
    "stop": ("mid_epoch", "epoch_end", "epoch_start", "signal"),
    "accumulation": (1, 3),
    "loss": ("mean", "items"),
    "precision": ("fp32", "bf16", "fp16"),
    "ema": (False, True),
    "schedule": ("constant", "warmup_cosine"),
    "limit": ("steps", "epochs"),
    "nan": (False, True),
    "ranks": ("1", "2", "2to1"),
}


@dataclass(frozen=True)
class Case:
    """One combination of features; every field one of :data:`AXES`'s values."""

    optimizers: str = "one"
    format: str = "full"
    storage: str = "local"
    stop: str = "mid_epoch"
    accumulation: int = 1
    loss: str = "mean"
    precision: str = "fp32"
    ema: bool = False
    schedule: str = "constant"
    limit: str = "steps"
    nan: bool = False
    ranks: str = "1"

    def __post_init__(self) -> None:
        for field, values in AXES.items():
            if getattr(self, field) not in values:
                raise ValueError(f"{field}={getattr(self, field)!r}: not one of {values}")

    @property
    def id(self) -> str:
        """The case's name, one token per axis, in :data:`AXES`'s order."""
        return "-".join([
            self.optimizers, self.format, self.storage, self.stop, f"acc{self.accumulation}", self.loss,
            self.precision, "ema" if self.ema else "noema", self.schedule, self.limit,
            "nan" if self.nan else "finite", f"r{self.ranks}",
        ])

    @classmethod
    def from_id(cls, case_id: str) -> Case:
        """The case :attr:`id` names."""
        tokens = dict(zip(AXES, case_id.split("-"), strict=True))
        return cls(
            **{**tokens, "accumulation": int(tokens["accumulation"].removeprefix("acc")),
               "ema": tokens["ema"] == "ema", "nan": tokens["nan"] == "nan", "ranks": tokens["ranks"].removeprefix("r")}
        )

    @property
    def zero_stage(self) -> int | None:
        """The ZeRO stage of a DeepSpeed case, else ``None``."""
        return int(self.format.removeprefix("zero")) if self.format.startswith("zero") else None

    @property
    def world(self) -> int:
        """The ranks the stopped run trains on."""
        return 1 if self.ranks == "1" else 2

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps per epoch on the stopped run's ranks."""
        return ITEMS // BATCH // self.accumulation

    @property
    def stop_step(self) -> int:
        """The step after which the stopped run saves and stops."""
        per_epoch = self.steps_per_epoch
        return {
            "mid_epoch": per_epoch // 2 + 1,  # in epoch 0, some batches left
            "epoch_end": per_epoch,  # the last step of epoch 0
            "epoch_start": per_epoch + 1,  # the first step of epoch 1
            "signal": per_epoch + 2 if per_epoch > 2 else per_epoch + 1,  # in epoch 1, mid-accumulation
        }[self.stop]

    @property
    def total_steps(self) -> int:
        """The steps of the whole run (``max_steps``, or what ``max_epochs`` amounts to)."""
        return 2 * self.steps_per_epoch + 2 if self.limit == "steps" else 3 * self.steps_per_epoch

    def settings(self) -> dict[str, Any]:
        """The trainer's settings (keywords), the same on any number of ranks (the loader's
        batch keeps the global batch)."""
        settings: dict[str, Any] = {
            "seed": SEED,
            "gradient_accumulation_steps": self.accumulation,
            "device": "cpu",
        }
        if self.limit == "steps":
            settings["max_steps"] = self.total_steps
        else:
            settings["max_epochs"] = 3
        if self.precision != "fp32":
            settings["mixed_precision"] = self.precision
        if self.schedule == "warmup_cosine":
            settings["lr_schedule"] = {
                "name": "cosine", "warmup_steps": 2, "final_lr_ratio": 0.1, "decay_steps": self.total_steps,
            }
        if self.nan and self.precision != "fp16":  # fp16's refused updates are bounded by min_loss_scale
            settings["max_non_finite_grad_retries"] = 2
        if self.zero_stage is not None:
            settings["deepspeed"] = {"zero_optimization": {"stage": self.zero_stage}, "zero_allow_untested_optimizer": True}
        return settings


def deepspeed_refuses(case: Case) -> str | None:
    """Why DeepSpeed does not take part in ``case`` (``None``: it does, or the case is not DeepSpeed's).

    What deepspeed refuses before step 1 (several optimizers, a fused one, a ``Loss``, EMA at ZeRO-3), what its
    engine cannot do here (fp16 on the CPU, object storage), and what this harness runs elsewhere (a signal stop
    and one rank run in this process, which has no process group for the engine; 2 ranks resumed on 1 is refused).
    """
    if case.zero_stage is None:
        return None
    rules = {
        "deepspeed drives one optimizer, not fused": case.optimizers != "one",
        "deepspeed takes a plain loss": case.loss != "mean",
        "fp16 has no DeepSpeed engine on the CPU": case.precision == "fp16",
        "a DeepSpeed engine writes local files only": case.storage != "local",
        "EMA reads whole parameters, which ZeRO-3 partitions": case.ema and case.zero_stage == 3,
        "DeepSpeed runs on 2 ranks here, resumed on 2": case.ranks != "2" or case.stop == "signal",
    }
    found = [rule for rule, applies in rules.items() if applies]
    return "; ".join(found) or None


class Items(Dataset):
    """A fixed regression problem whose items carry their index: ``(x, y, index)``."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(ITEMS, 4, generator=g)
        self.y = self.x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(ITEMS, 1, generator=g)

    def __len__(self) -> int:
        return ITEMS

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[index], self.y[index], index


class MatrixTrainer(BaseTrainer):
    """A 4-16-1 MLP with dropout (torch's generator at every forward) over a shuffling
    ``DataLoader`` (a ``DistributedSampler`` under a process group), trained as ``case`` says.

    Args:
        case: The combination to train.
        hooks: The run's hooks.
        nan_at: A step whose first try's ``forward`` returns a NaN loss.
        pause: Called in ``forward`` with the step and the count of forwards in it so far (to
            deliver a signal there).
    """

    def __init__(self, *args: Any, case: Case, hooks: list[BaseHook], nan_at: int | None = None,
                 pause: Any = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.case = case
        self._hooks = hooks
        self.nan_at = nan_at
        self.pause = pause
        self.draws: list[tuple[int, str, tuple[int, ...]]] = []
        self._nan_done = False
        self._microstep = (0, 0)

    def build_data_loader(self):
        data = Items()
        if self.case.ranks == "1":
            return DataLoader(data, batch_size=BATCH, shuffle=True)
        # The same global order on any number of ranks; the same global batch (BATCH items a microstep).
        rank, ranks = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        sampler = DistributedSampler(data, num_replicas=ranks, rank=rank, shuffle=True, seed=SEED)
        return DataLoader(data, batch_size=BATCH // ranks, sampler=sampler)

    def build_model(self):
        model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1))
        wrap = dist.is_initialized() and self.case.zero_stage is None  # DeepSpeed wraps the plain module itself
        return nn.parallel.DistributedDataParallel(model) if wrap else model

    def build_optimizer(self):
        layers = self.unwrapped_model
        if self.case.optimizers == "fused":
            return torch.optim.AdamW(layers.parameters(), lr=0.01, fused=True)
        if self.case.optimizers == "several":
            return {
                "body": torch.optim.SGD(layers[0].parameters(), lr=0.01, momentum=0.9),
                "head": torch.optim.AdamW(layers[3].parameters(), lr=0.01),
            }
        return torch.optim.SGD(layers.parameters(), lr=0.01, momentum=0.9)

    def build_hooks(self):
        return self._hooks

    def forward(self, batch, optimizer: str = ""):
        x, y, index = batch
        step = self.step
        self._microstep = (step, self._microstep[1] + 1) if self._microstep[0] == step else (step, 1)
        self.draws.append((step, optimizer, tuple(index.tolist())))
        if self.pause is not None:
            self.pause(step, self._microstep[1])
        if self.case.zero_stage is not None:  # the engine casts the module, not its inputs (bf16)
            x = x.to(next(self.model.parameters()).dtype)
        per_item = ((self.model(x).float() - y) ** 2).squeeze(1)
        if self.case.loss == "items":
            mask = (x[:, 0] > -0.5).float()
            loss: Any = Loss((per_item * mask).sum(), mask.sum())
            value = loss.sum
        else:
            loss = value = per_item.mean()
        if step == self.nan_at and not self._nan_done:  # the step's first try only
            loss = Loss(loss.sum * NAN, loss.count) if isinstance(loss, Loss) else loss * NAN
            self._nan_done = self._microstep[1] == self.case.accumulation * len(self.optimizers)
        return loss, {"loss": value.detach()}


class StopAt(BaseHook):
    """Asks the run to exit after ``step`` (whose checkpoint the interval saves)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_after_step(self, trainer):
        if trainer.step == self.step:
            trainer.request_exit()


class Stopped(Exception):
    """Ends a run on several ranks right after its stop step's save, as a preemption would: an
    exit request there is agreed on a little later (docs/distributed.md), not at that step."""


def checkpoint_path(case: Case, root: Path, s3: Any = None) -> tuple[str, dict[str, Any] | None]:
    """Where the case's checkpoints go (``root`` names the run) and the storage options."""
    if case.storage == "local":
        return str(Path(root) / "checkpoints"), None
    if case.storage == "memory":
        return f"memory://matrix-{uuid.uuid5(uuid.NAMESPACE_URL, str(root)).hex}/checkpoints", None
    if s3 is None:
        raise ValueError(f"{case.id}: object storage needs the s3 server")
    return f"{s3['bucket']}/{uuid.uuid5(uuid.NAMESPACE_URL, str(root)).hex}/checkpoints", s3["options"]


def hooks_for(case: Case, root: Path, s3: Any = None) -> list[BaseHook]:
    """The case's hooks: a CheckpointingHook saving at the stop step's interval, and EMA."""
    path, options = checkpoint_path(case, root, s3)
    format, _, mode = case.format.partition("_") if case.zero_stage is None else ("full", "", "")
    hooks: list[BaseHook] = [
        CheckpointingHook(interval=case.stop_step, keep_previous=1, path=path, storage_options=options,
                          format=format, async_save=mode == "async", exit_signals=["SIGTERM"]),
    ]
    if case.ema:
        hooks.append(EmaHook(decay=0.9))
    return hooks


def train(case: Case, root: Path, run: str, s3: Any = None, pause: Any = None) -> dict[str, Any]:
    """Train one run of ``case`` (``"unbroken"``, ``"stopped"`` or ``"resumed"``) with its
    checkpoints under ``root``; return its record (see :func:`record`).

    The three runs of a case share one declaration. A ``ChangedSettingsWarning`` is an error: a resume with other
    settings would not be a continuation.
    """
    hooks = hooks_for(case, root, s3)
    stop = run == "stopped" and case.stop != "signal"
    if stop and case.world == 1:
        hooks.append(StopAt(case.stop_step))
    nan_at = case.stop_step + 1 if case.nan else None
    trainer = MatrixTrainer(case=case, hooks=hooks, nan_at=nan_at, pause=pause, workspace=root / "workspace",
                            **case.settings())
    if stop and case.world > 1:

        def crash(trainer: MatrixTrainer) -> None:
            if trainer.step == case.stop_step:
                raise Stopped(case.stop_step)

        trainer.on_exit("checkpointing", crash)
    code = 0
    logged = _Warnings()
    trainer.logger.addHandler(logged)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from trainloop.trainer import ChangedSettingsWarning

        warnings.simplefilter("error", ChangedSettingsWarning)
        try:
            trainer.train()
        except SystemExit as exit:
            code = int(exit.code or 0)
        except Stopped:
            _destroy_engine(trainer)
            return {"draws": list(trainer.draws), "step": trainer.step, "code": 0}
        except Exception as error:  # noqa: BLE001 - a failed run is a finding of the matrix, in one line
            line = str(error).splitlines()[0] if str(error) else ""
            return {"draws": list(trainer.draws), "step": trainer.step, "code": 1, "error": f"{type(error).__name__}: {line}"}
        finally:
            trainer.logger.removeHandler(logged)
    recorded = record(trainer, hooks, code, [f"{w.category.__name__}: {w.message}" for w in caught] + logged.lines)
    _destroy_engine(trainer)
    return recorded


def _destroy_engine(trainer: MatrixTrainer) -> None:
    """End a DeepSpeed run's engine (ZeRO-3's hooks on the module), as a script would at exit."""
    if trainer.loop.engine is not None:
        trainer.loop.engine.destroy()


class _Warnings(logging.Handler):
    """Keeps the messages of the warnings a run logs."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"log: {record.getMessage()}")


def record(trainer: MatrixTrainer, hooks: list[BaseHook], code: int, warned: list[str]) -> dict[str, Any]:
    """What a run did: its draws, its final state, its exit code and its warnings, raised or
    logged (a run that failed has its draws, its step and ``error``, one line, instead)."""
    state = trainer.state_dict()
    training = state["training_state"]
    final: dict[str, Any] = {
        "model": {k: v.detach().clone() for k, v in trainer.unwrapped_model.state_dict().items()},
        "optimizer": training.get("optimizer", training.get("optimizers")),
        "lr_scheduler": training.get("lr_scheduler", training.get("lr_schedulers")),
        "grad_scaler": training.get("grad_scaler"),
        "rng": torch.get_rng_state(),
    }
    if trainer.loop.engine is not None:  # the engine holds model, optimizer and scheduler, partitioned
        final.update(engine_state(trainer.loop.engine))
    ema = [hook for hook in hooks if isinstance(hook, EmaHook)]
    if ema:
        final["ema"] = ema[0].ema_model.state_dict()  # type: ignore[union-attr]
    return {"draws": list(trainer.draws), "final": final, "step": trainer.step, "code": code, "warned": warned}


def engine_state(engine: Any) -> dict[str, Any]:
    """A DeepSpeed engine's state on this rank: its module whole (gathered at ZeRO-3), its optimizer's (partitions,
    fp32 master weights, moments), its lr scheduler's and its counters.

    The padding that ends the last rank's fp32 partition at ZeRO-3 (no parameter's) is left out, as DeepSpeed's
    ``get_groups_without_padding`` leaves it; its loss scaler, an object, is compared by its values.
    """
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        model = {key: value.detach().clone() for key, value in engine.module.state_dict().items()}
    optimizer = engine.optimizer.state_dict()
    if "loss_scaler" in optimizer:
        optimizer["loss_scaler"] = vars(optimizer["loss_scaler"])
    if "fp32_flat_groups" in optimizer:
        optimizer["fp32_flat_groups"] = engine.optimizer.get_groups_without_padding(optimizer["fp32_flat_groups"])
    return {
        "model": model,
        "optimizer": optimizer,
        "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
        "engine": {"global_steps": engine.global_steps, "skipped_steps": engine.skipped_steps,
                   "global_samples": engine.global_samples},
    }


def flatten(value: Any, path: str = "") -> dict[str, Any]:
    """A nested state as ``{"a.b.0": leaf}``."""
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(flatten(item, f"{path}.{key}" if path else str(key)))
        return out
    if isinstance(value, (list, tuple)) and not (value and all(isinstance(v, (int, float, str)) for v in value)):
        out = {}
        for i, item in enumerate(value):
            out.update(flatten(item, f"{path}.{i}" if path else str(i)))
        return out
    return {path: value}


def same(a: Any, b: Any) -> bool:
    """Bitwise equality of two leaves (tensors by ``torch.equal``, NaN equal to NaN)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True
    return bool(a == b)


def divergences(case: Case, unbroken: dict[str, Any], stopped: dict[str, Any], resumed: dict[str, Any],
                compare_state: bool = True) -> list[str]:
    """Where the stopped-then-resumed run differs from the unbroken one (empty: it is exact).

    Samples: every forward's items, step and optimizer, the stopped run's up to its stop step
    and the resumed run's after it, against the unbroken run's. State (``compare_state``): every
    tensor and value of the final model, optimizers, schedulers, grad scaler, EMA and generator.
    """
    failed = [f"the {name} run failed: {run['error']}" for name, run in
              (("unbroken", unbroken), ("stopped", stopped), ("resumed", resumed)) if "error" in run]
    if failed:
        return failed
    found: list[str] = []
    stop = case.stop_step
    if stopped["step"] != stop:
        found.append(f"the stopped run ended at step {stopped['step']}, not {stop}")
    draws = [d for d in stopped["draws"] if d[0] <= stop] + [d for d in resumed["draws"] if d[0] > stop]
    want = unbroken["draws"]
    for i, (got, expected) in enumerate(zip(draws, want)):
        if got != expected:
            found.append(f"samples differ from draw {i}: step {got[0]} drew {list(got[2])}, "
                         f"the unbroken run {list(expected[2])} at step {expected[0]}")
            break
    else:
        if len(draws) != len(want):
            found.append(f"{len(draws)} draws against the unbroken run's {len(want)}")
    if resumed["step"] != unbroken["step"]:
        found.append(f"the resumed run ended at step {resumed['step']}, the unbroken run at {unbroken['step']}")
    if compare_state:
        got_state, want_state = flatten(resumed["final"]), flatten(unbroken["final"])
        differ = [key for key in want_state if key not in got_state or not same(got_state[key], want_state[key])]
        differ += [key for key in got_state if key not in want_state]
        if differ:
            found.append(f"final state differs in {len(differ)} entries: {', '.join(differ[:6])}")
    return found


def case_dict(case: Case) -> dict[str, Any]:
    """``case`` as JSON-ready data (what the script's jobs carry)."""
    return dataclasses.asdict(case)


def _join(rank: int, world: int, port: int) -> None:
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)


def _pause_for_signal(case: Case) -> Any:
    def pause(step: int, microstep: int) -> None:
        if step == case.stop_step and microstep == max(1, case.accumulation - 1) and not pause.done:  # type: ignore[attr-defined]
            pause.done = True  # type: ignore[attr-defined]
            print("paused", case.id, flush=True)
            if not sys.stdin.readline():
                raise RuntimeError("stdin closed while paused")

    pause.done = False  # type: ignore[attr-defined]
    return pause


def run_job(job: dict[str, Any]) -> None:
    """Run one job (see the module's docstring)."""
    if "join" in job:
        _join(**job["join"])
        return
    case = Case(**job["case"])
    rank = dist.get_rank() if dist.is_initialized() else 0
    pause = _pause_for_signal(case) if job["run"] == "stopped" and case.stop == "signal" else None
    result = train(case, Path(job["root"]), job["run"], s3=job.get("s3"), pause=pause)
    torch.save(result, f"{job['record']}.rank{rank}.pt")
    print(rank, "done", case.id, job["run"], result["code"], flush=True)


def main() -> None:
    """Run the jobs of ``sys.argv[1]`` one after another, or with ``serve``, each JSON line of
    stdin as it comes (see the module's docstring)."""
    torch.set_num_threads(1)  # as the test process: the same arithmetic
    if sys.argv[1] == "serve":
        while line := sys.stdin.readline():
            run_job(json.loads(line))
        return
    for job in json.loads(sys.argv[1]):
        run_job(job)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
