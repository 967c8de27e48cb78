"""Training runs that tests/processes/test_resume_other_world_size.py starts in new processes: stopped
on some number of ranks, resumed on another, one after another in the same processes.

Needs ``tests/`` and the repository root on ``PYTHONPATH``. Run as::

    python reshard_worker.py '<JSON list of steps>'

Each step is a JSON object, either ``{"join": {"rank": r, "world": w, "port": p}}``, which
leaves the process group the process is in (if any) and joins a gloo group of ``w`` ranks on
127.0.0.1:``p`` (none for ``w`` = 1: a single process), or a training run on the group:

    name           printed with the run's event
    workspace      the trainer's workspace
    copy_from      a workspace rank 0 copies to ``workspace`` first (the others wait for it)
    length         the dataset's items; each records the indices it is asked for
    loader         "distributed": a DistributedSampler (shuffle, drop_last, seed 7) over the
                   group's ranks; "plain": ``DataLoader(shuffle=True)`` (one process)
    shuffle, drop_last   the DistributedSampler's
    batch          the loader's batch size
    accumulation   ``gradient_accumulation_steps``
    max_steps      the run's ``max_steps``
    stop_at        stop after this step, with a checkpoint of it (``None``: run to ``max_steps``)
    format         the checkpoint's format, "full" or "sharded"
    out            ``torch.save`` here (suffixed ``.rank<r>``): the final parameters, the step
                   the run started from, and every microstep's (step, epoch or None, indices) on this rank
    refused        the resume is expected to be refused (``ChangedGlobalBatchError``): print
                   ``<rank> refused <name> <message>`` instead of failing

The model is wrapped in DDP on 2 or more ranks. Events, one line each, flushed:
``<rank> done <name>``, ``<rank> refused <name> <message>``.
"""

from __future__ import annotations

import json
import shutil
import sys
from typing import Any

import torch
import torch.distributed as dist
from tiny_trainer import TinyTrainer, make_data
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from trainloop import BaseHook
from trainloop.core.training_state import ChangedGlobalBatchError
from trainloop.distributed import destroy
from trainloop.hooks.checkpointing import CheckpointingHook

SEED = 7


def world() -> tuple[int, int]:
    """This process's rank and the world size (0 and 1 outside a process group)."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class Recording(Dataset):
    """``make_data(length)``, keeping the indices asked for since the last ``take``."""

    def __init__(self, length: int) -> None:
        self.data = make_data(length)
        self.asked: list[int] = []

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> Any:
        self.asked.append(index)
        return self.data[index]

    def take(self) -> list[int]:
        taken, self.asked = self.asked, []
        return taken


class ReshardTrainer(TinyTrainer):
    """TinyTrainer over a recording dataset, DDP under a process group; notes each microstep's samples."""

    def __init__(self, run: dict[str, Any], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.run = run
        self.dataset = Recording(run["length"])
        self.microsteps: list[tuple[int, int, list[int]]] = []

    def build_data_loader(self):
        run = self.run
        if run["loader"] == "plain":
            return DataLoader(self.dataset, batch_size=run["batch"], shuffle=True)
        rank, ranks = world()
        sampler = DistributedSampler(self.dataset, num_replicas=ranks, rank=rank, shuffle=run["shuffle"], seed=SEED,
                                     drop_last=run["drop_last"])
        return DataLoader(self.dataset, batch_size=run["batch"], sampler=sampler)

    def build_model(self):
        model = super().build_model()
        return nn.parallel.DistributedDataParallel(model) if dist.is_initialized() and world()[1] > 1 else model

    def forward(self, batch):
        epoch = getattr(self.data_loader.sampler, "epoch", None)  # a DistributedSampler's, set as each epoch begins
        self.microsteps.append((self.step, epoch, self.dataset.take()))
        return super().forward(batch)


class Started(BaseHook):
    def __init__(self) -> None:
        self.step: int | None = None

    def on_before_train(self, trainer):
        self.step = trainer.step


def train(run: dict[str, Any]) -> None:
    """Train one run; save what it drew and its final parameters to ``run["out"]``."""
    rank = world()[0]
    started = Started()
    hooks: list[BaseHook] = [started, CheckpointingHook(interval=run.get("stop_at") or 1000, format=run["format"])]
    trainer = ReshardTrainer(
        run, max_steps=run.get("stop_at") or run["max_steps"], gradient_accumulation_steps=run["accumulation"], seed=SEED,
        workspace=run["workspace"], device="cpu", hooks=hooks,
    )
    try:
        trainer.train()
    except ChangedGlobalBatchError as error:
        if not run.get("refused"):
            raise
        print(rank, "refused", run["name"], error, flush=True)
        return
    params = [p.detach().clone() for p in trainer.unwrapped_model.parameters()]
    record = {"params": params, "started": started.step, "step": trainer.step, "microsteps": trainer.microsteps}
    torch.save(record, f"{run['out']}.rank{rank}")
    print(rank, "done", run["name"], flush=True)


def join(rank: int, world: int, port: int) -> None:
    """Leave the current group, if any; join a gloo group of ``world`` ranks (none for one)."""
    destroy(barrier=True)  # wait for every rank: a clean gloo exit
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)


def copy_workspace(source: str, target: str) -> None:
    if world()[0] == 0:
        shutil.copytree(source, target, symlinks=True)
    if dist.is_initialized():
        dist.barrier()


def main() -> None:
    steps = json.loads(sys.argv[1])
    torch.set_num_threads(1)  # several workers share two cores
    try:
        for step in steps:
            if "join" in step:
                join(**step["join"])
                continue
            if step.get("copy_from"):
                copy_workspace(step["copy_from"], step["workspace"])
            train(step)
    finally:
        destroy(barrier=sys.exc_info()[0] is None)


if __name__ == "__main__":
    main()
