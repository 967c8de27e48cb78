"""Training runs that tests/processes/test_exact_resume_processes.py starts in new processes, to stop
them with a real SIGTERM or SIGKILL and to resume them.

Needs ``tests/`` and the repository root on ``PYTHONPATH``. Run as::

    python resume_child.py '<JSON list of runs>'

The runs execute one after another in this process (a resume of several workspaces shares one
torch import). Each run is a JSON object:

    workspace          the trainer's workspace (checkpoints go to ``<workspace>/checkpoints``)
    max_steps          the run's ``max_steps``
    accumulation       ``gradient_accumulation_steps``
    interval           ``CheckpointingHook(interval=...)``; ``null`` for no CheckpointingHook
                       (an uninterrupted reference run)
    pause_before_step  block on a stdin line as this step begins (the parent signals meanwhile)
    pause_after_save   block on a stdin line once the checkpoint of this step is written
    pause_rank         the only rank that pauses before a step (default: every rank)
    out                ``torch.save`` the final parameters and the start step here
    loader             ``"plain"``: a plain shuffling ``torch.utils.data.DataLoader`` instead of
                       the ``StatefulDataLoader`` (under a group: over a ``DistributedSampler``)
    format             ``CheckpointingHook(format=...)`` (default ``"full"``)
    validate           ``ValidationHook(interval=...)`` over a DataLoader, which draws from torch's
                       generator (its base seed, and a sampled metric); absent: no validation

Under a torchrun-style environment (``WORLD_SIZE`` > 1, ``RANK``, ``MASTER_ADDR``,
``MASTER_PORT``) the process joins a gloo group and the model is wrapped in DDP, each rank
drawing its shard through a shuffling ``DistributedSampler``.

Every event is printed on its own line, flushed, prefixed by the rank:

    <rank> started <step>    in on_before_train (after any checkpoint was loaded)
    <rank> paused <step>     blocked before a step or after a save, reading stdin
    <rank> saved <step>      a checkpoint of this step was written (every rank past the barrier)
    <rank> done <step>       the run ended cleanly at this step
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from typing import Any

import torch
import torch.distributed as dist
from tiny_trainer import TinyTrainer, make_data
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from trainloop import BaseHook
from trainloop.distributed import destroy
from trainloop.hooks.checkpointing import CheckpointingHook
from trainloop.hooks.validation import ValidationHook
from trainloop.trainer import ChangedSettingsWarning

SEED = 3


def world() -> tuple[int, int]:
    """This process's rank and the world size (0 and 1 outside a process group)."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class DropoutTrainer(TinyTrainer):
    """Dropout (torch's generator, every step) over a shuffling StatefulDataLoader of 5 batches
    per epoch, so stops fall mid-epoch; DDP with a shuffling DistributedSampler under a group."""

    plain_loader = False

    def build_data_loader(self):
        data = make_data(40)
        if self.plain_loader and dist.is_initialized():  # 5 batches of 4 an epoch on each of 2 ranks
            return DataLoader(data, batch_size=4, sampler=DistributedSampler(data, shuffle=True, seed=SEED))
        if self.plain_loader:  # no state of its own: trainloop saves where its sampler is
            return DataLoader(data, batch_size=8, shuffle=True)
        if dist.is_initialized():
            sampler = DistributedSampler(data, shuffle=True, seed=SEED)
            return StatefulDataLoader(data, batch_size=4, sampler=sampler)
        # No generator= argument: shuffling then draws from torch's global generator, which the
        # checkpoint restores per rank (StatefulDataLoader does not save a generator given to it).
        return StatefulDataLoader(data, batch_size=8, shuffle=True)

    def build_model(self):
        # Initialised from the generator the `seed` setting seeded: no reseeding here.
        model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1))
        return nn.parallel.DistributedDataParallel(model) if dist.is_initialized() else model


class PlainLoaderTrainer(DropoutTrainer):
    plain_loader = True


def validation(trainer: DropoutTrainer) -> dict[str, Any]:
    """The loss over a DataLoader (making its iterator draws a base seed from torch's generator), and a random draw."""
    losses = [nn.functional.mse_loss(trainer.model(x), y) for x, y in DataLoader(make_data(16, seed=1), batch_size=8)]
    return {"loss": torch.stack(losses).mean(), "draw": torch.rand(())}


def trainer_for(run: dict[str, Any], hooks: list[BaseHook]) -> DropoutTrainer:
    """The trainer a run spec describes (the test builds its references with it too)."""
    cls = PlainLoaderTrainer if run.get("loader") == "plain" else DropoutTrainer
    if run.get("validate") is not None:
        hooks = [ValidationHook(validation, interval=run["validate"]), *hooks]
    return cls(
        max_steps=run["max_steps"],
        gradient_accumulation_steps=run.get("accumulation", 1),
        seed=SEED,
        workspace=run["workspace"],
        hooks=hooks,
    )


class ReportHook(BaseHook):
    """Prints the events the parent waits for, and blocks on stdin where the run spec says."""

    def __init__(self, run: dict[str, Any]) -> None:
        self.run = run
        self.rank = world()[0]
        self.started: int | None = None

    def say(self, *words: object) -> None:
        print(self.rank, *words, flush=True)

    def pause(self, step: int) -> None:
        self.say("paused", step)
        if not sys.stdin.readline():
            raise RuntimeError("stdin closed while paused")

    def on_before_train(self, trainer):
        self.started = trainer.step
        self.say("started", trainer.step)

    def on_before_step(self, trainer):
        rank = self.run.get("pause_rank")
        if trainer.step == self.run.get("pause_before_step") and rank in (None, self.rank):
            self.pause(trainer.step)

    def after_save(self, trainer):
        # On leaving checkpointing: the saves are done, every rank past their barrier.
        self.say("saved", trainer.step)
        if trainer.step == self.run.get("pause_after_save"):
            self.pause(trainer.step)

    def on_after_train(self, trainer):
        if trainer.error is None:
            self.say("done", trainer.step)


def train(run: dict[str, Any]) -> None:
    """Train one run; save its final parameters to ``run["out"]`` when it ends cleanly."""
    report = ReportHook(run)
    hooks: list[BaseHook] = []
    if run.get("interval") is not None:
        hooks.append(CheckpointingHook(interval=run["interval"], exit_signals=["SIGTERM"], format=run.get("format", "full")))
    hooks.append(report)
    trainer = trainer_for(run, hooks)
    trainer.on_exit("checkpointing", report.after_save)
    trainer.train()  # a SIGTERM ends it with SystemExit(143) after the save
    if run.get("out"):
        rank = world()[0]
        params = [p.detach().clone() for p in trainer.unwrapped_model.parameters()]
        torch.save({"params": params, "started": report.started, "step": trainer.step}, f"{run['out']}.rank{rank}")


def main() -> None:
    runs = json.loads(sys.argv[1])
    # A resume with other settings would not be a continuation: fail instead of warning.
    warnings.simplefilter("error", ChangedSettingsWarning)
    torch.set_num_threads(1)  # several children share two cores
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("gloo")  # env:// from RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    try:
        for run in runs:
            train(run)
    finally:
        if distributed:
            destroy(barrier=sys.exc_info()[0] is None)  # wait for every rank: a clean gloo exit


if __name__ == "__main__":
    main()
