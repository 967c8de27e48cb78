"""Processes the checkpoint tests start: a run to signal or kill, and 2-rank gloo workers.

Needs ``tests/support/`` and the repository root on ``PYTHONPATH`` (or ``sys.path``). As a script it
prints one line per event, flushed, so the parent can time its signal:

    started <step>           after any checkpoint was loaded (in on_before_train)
    step <step>              after each step
    saving <step>            as a save begins (before CheckpointingHook writes)
    exiting <state> <step>   in on_after_train

    forked <pid>             (save-loop) a run began in process <pid>, to be killed
    reaped <pid> <code>      (save-loop) that process has ended (-9: by SIGKILL)

    writing <step>           (preempt) the exit save's files are about to be written
    settling                 (preempt) the end of the run waits for a save in flight

Modes:
    signal <workspace> <max_steps>   sleeps a little per step; saves only at the end or on SIGTERM
    preempt <workspace> <async 0|1>  CheckpointingHook's default exit signals; the (only) save,
                                     at the exit, blocks on a stdin line before writing
    save-loop <workspace>            for each line ``<format> <async 0|1>`` read from stdin,
                                     forks a run that resumes from ``latest`` and saves a ~16 MB
                                     checkpoint every step, endlessly, in that format, and waits
                                     for it to be killed (forking spares a torch import per run)

Imported by the tests, it provides :class:`Child`, which runs this script and reads its lines,
and :func:`formats_worker`, a rank of a 2-process gloo group started with
``torch.multiprocessing``.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from child_process import ChildProcess
from tiny_trainer import TinyTrainer, make_data
from torch import nn

from trainloop import BaseHook
from trainloop.distributed import destroy
from trainloop.hooks.checkpointing import CheckpointingHook


class Child(ChildProcess):
    """This script running in a subprocess (see ``ChildProcess``).

    Args:
        tmp_path: Where its stderr is kept (shown when it ends unexpectedly).
        *args: The script's arguments (mode, workspace...).
    """

    def __init__(self, tmp_path: Path, *args: str) -> None:
        super().__init__(__file__, list(args), tmp_path)


def say(*words: object) -> None:
    """Print one line in a single write: a process killed while saying it says all or nothing."""
    os.write(sys.stdout.fileno(), (" ".join(map(str, words)) + "\n").encode())


class ReportHook(BaseHook):
    """Prints the events the parent waits for; optionally sleeps at each step so a signal lands mid-run."""

    def __init__(self, sleep: float = 0.0) -> None:
        self.sleep = sleep

    def _say(self, *words: object) -> None:
        say(*words)

    def on_before_train(self, trainer):
        self._say("started", trainer.step)

    def on_before_step(self, trainer):
        if self.sleep:
            time.sleep(self.sleep)

    def on_after_step(self, trainer):
        self._say("step", trainer.step)

    def on_enter_checkpointing(self, trainer):
        self._say("saving", trainer.step)

    def on_after_train(self, trainer):
        self._say("exiting", trainer.state.value, trainer.step)


class BallastHook(BaseHook):
    """Adds a large tensor to every checkpoint, so that a save takes long enough to be killed in."""

    def __init__(self, numel: int = 4 * 1024 * 1024) -> None:
        self.weights = torch.arange(numel, dtype=torch.float32)

    def on_state_dict(self, trainer, state_dict):
        state_dict[self.name] = {"weights": self.weights, "step": trainer.step}


def warm_up() -> None:
    """Save and resume once in each format, in a scratch directory, so that the forked runs
    start with every lazy import and first-call set-up done."""
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        for format in ("full", "sharded"):
            for max_steps in (1, 2):
                hook = CheckpointingHook(interval=1, format=format, async_save=max_steps == 2)
                TinyTrainer(max_steps=max_steps, workspace=Path(scratch) / format, hooks=[BallastHook(16), hook]).train()


def fork_save_loops(workspace: str) -> None:
    """Per line on stdin, run the save loop in a forked process and report its pid and its end."""
    warm_up()
    while line := sys.stdin.readline():
        format, async_save = line.split()
        pid = os.fork()
        if pid == 0:
            try:
                hook = CheckpointingHook(interval=1, keep_previous=1, format=format, async_save=async_save == "1")
                hooks = [BallastHook(), ReportHook(), hook]
                TinyTrainer(max_steps=1_000_000, workspace=workspace, hooks=hooks).train()
            finally:
                os._exit(1)  # only reached if the run was not killed
        say("forked", pid)
        _, status = os.waitpid(pid, 0)
        say("reaped", pid, os.waitstatus_to_exitcode(status))


# -- 2-rank workers ------------------------------------------------------------------------------

DATA = make_data(64)
GLOBAL_BATCH = 8


class StepDataTrainer(TinyTrainer):
    """TinyTrainer whose data is a function of the step alone, split over however many ranks.

    Step ``s`` trains on the rows ``8(s-1) .. 8s-1`` (mod 64) of ``make_data(64)``; rank ``r``
    of ``w`` takes every ``w``-th of them from row ``r``. DDP and FSDP average the ranks'
    gradients, so any world size computes the same steps, and a run resumed on another number
    of ranks continues the same training. SGD with momentum and a step schedule give the
    checkpoint state that matters.

    Args:
        wrap: ``"ddp"``, ``"ddp_unused"`` (``find_unused_parameters=True``) or ``"fsdp"`` (FSDP2
            ``fully_shard``) under a process group.
    """

    def __init__(self, *args, wrap: str = "ddp", **kwargs):
        super().__init__(*args, **kwargs)
        self.wrap = wrap

    def build_data_loader(self):
        return itertools.repeat(None)

    def build_model(self):
        model = super().build_model()
        if not dist.is_initialized():
            return model
        if self.wrap == "fsdp":
            from torch.distributed.fsdp import fully_shard

            fully_shard(model)
            return model
        # find_unused_parameters: DDP then never rebuilds its buckets (see docs/checkpointing.md)
        return nn.parallel.DistributedDataParallel(model, find_unused_parameters=self.wrap == "ddp_unused")

    def build_optimizer(self):
        return torch.optim.SGD(self.model.parameters(), lr=self.lr, momentum=0.9)

    def build_lr_scheduler(self):
        return torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=3, gamma=0.5)

    def forward(self, _):
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        start = GLOBAL_BATCH * ((self.step - 1) % (len(DATA) // GLOBAL_BATCH))
        rows = torch.arange(start + rank, start + GLOBAL_BATCH, world)
        x, y = DATA.tensors[0][rows], DATA.tensors[1][rows]
        loss = nn.functional.mse_loss(self.model(x), y)
        return loss, {"mse": loss.detach()}


class TwoOptimizerTrainer(StepDataTrainer):
    """:class:`StepDataTrainer` with an SGD (momentum) and a scheduler per layer, by name."""

    def build_optimizer(self):
        layers = getattr(self.model, "module", self.model)
        return {
            "first": torch.optim.SGD(layers[0].parameters(), lr=self.lr, momentum=0.9),
            "last": torch.optim.SGD(layers[2].parameters(), lr=self.lr, momentum=0.9),
        }

    def build_lr_scheduler(self):
        return {
            name: torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
            for name, optimizer in self.optimizers.items()
        }

    def forward(self, batch, optimizer):
        return super().forward(batch)


class StartedAt(BaseHook):
    """Records the step training started from (after any checkpoint was loaded)."""

    step: int | None = None

    def on_before_train(self, trainer):
        self.step = trainer.step


def full_params(model: nn.Module) -> list[torch.Tensor]:
    """Every parameter as a whole tensor (a collective for FSDP's DTensor shards)."""
    from torch.distributed.tensor import DTensor

    return [(p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for p in model.parameters()]


def optimizer_tensors(trainer: TwoOptimizerTrainer) -> dict[str, list[torch.Tensor]]:
    """Each optimizer's momentum buffers, whole (a collective for FSDP's DTensor shards)."""
    from torch.distributed.tensor import DTensor

    return {
        name: [
            (buffer.full_tensor() if isinstance(buffer, DTensor) else buffer).clone()
            for buffer in (optimizer.state[p]["momentum_buffer"] for group in optimizer.param_groups
                           for p in group["params"])
        ]
        for name, optimizer in trainer.optimizers.items()
    }


#: label: (wrap, format, async_save) of the 2-rank runs that save at step 4 and resume to 8.
FORMAT_CASES = {
    "ddp_sharded": ("ddp", "sharded", False),
    "ddp_sharded_async": ("ddp", "sharded", True),
    "ddp_full_async": ("ddp", "full", True),
    "fsdp_sharded_async": ("fsdp", "sharded", True),
}


def formats_worker(rank: int, world: int, port: int, out: str) -> None:
    """One rank: an uninterrupted run, then each of :data:`FORMAT_CASES` saved at step 4 and
    resumed (same world size) to step 8, then an FSDP run that the full format refuses;
    results in ``<out>/rank<rank>.pt``."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results: dict[str, object] = {}
        straight = StepDataTrainer(max_steps=8)
        straight.train()
        results["straight"] = full_params(straight.model)
        for label, (wrap, format, async_save) in FORMAT_CASES.items():
            workspace = Path(out) / label
            hook = CheckpointingHook(interval=2, format=format, async_save=async_save)
            StepDataTrainer(max_steps=4, workspace=workspace, wrap=wrap, hooks=[hook]).train()
            started = StartedAt()
            hook = CheckpointingHook(interval=100, keep_previous=1, format=format, async_save=async_save)
            resumed = StepDataTrainer(max_steps=8, workspace=workspace, wrap=wrap, hooks=[started, hook])
            resumed.train()
            results[label] = {"started": started.step, "params": full_params(resumed.model)}
        # Several optimizers, sharded: saved at step 4 and resumed to 8, against their own unbroken run.
        straight = TwoOptimizerTrainer(max_steps=8)
        straight.train()
        results["two_optimizers"] = {"straight": full_params(straight.model), "state": optimizer_tensors(straight)}
        for wrap in ("ddp", "fsdp"):
            workspace = Path(out) / f"{wrap}_two_optimizers"
            hook = CheckpointingHook(interval=2, format="sharded")
            TwoOptimizerTrainer(max_steps=4, workspace=workspace, wrap=wrap, hooks=[hook]).train()
            started = StartedAt()
            hook = CheckpointingHook(interval=100, format="sharded")
            resumed = TwoOptimizerTrainer(max_steps=8, workspace=workspace, wrap=wrap, hooks=[started, hook])
            resumed.train()
            results["two_optimizers"][wrap] = {
                "started": started.step, "params": full_params(resumed.model), "state": optimizer_tensors(resumed)
            }
        # FSDP's default state dict is sharded: a full checkpoint of it would be rank 0's shard.
        hook = CheckpointingHook(interval=2, format="full", load=None)
        try:
            StepDataTrainer(max_steps=2, workspace=Path(out) / "refused", wrap="fsdp", hooks=[hook]).train()
        except ValueError as error:
            results["full_refused"] = str(error)
        torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    finally:
        destroy(barrier=sys.exc_info()[0] is None)  # wait for every rank: a clean gloo exit


def preempt(workspace: str, async_save: bool) -> None:
    """A run with the default exit signals whose exit save pauses before writing, so that the
    parent can signal again while it is in flight (on the training thread, or in the background
    while the end of the run waits for it)."""
    from trainloop.checkpoint.manager import CheckpointManager

    write, settle = CheckpointManager.write_full, CheckpointManager.settle

    def paused_write(self, step, *args, **kwargs):
        say("writing", step)
        sys.stdin.readline()
        return write(self, step, *args, **kwargs)

    def announced_settle(self, agree):
        if self._pending is not None:
            say("settling")
        return settle(self, agree)

    CheckpointManager.write_full = paused_write
    CheckpointManager.settle = announced_settle
    hooks = [ReportHook(sleep=0.05), CheckpointingHook(interval=1_000_000, async_save=async_save)]
    TinyTrainer(max_steps=1_000_000, workspace=workspace, hooks=hooks).train()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["signal", "save-loop", "preempt"])
    parser.add_argument("workspace")
    parser.add_argument("max_steps", type=int, nargs="?", default=1_000_000)
    args = parser.parse_args()
    if args.mode == "save-loop":
        fork_save_loops(args.workspace)
        return
    if args.mode == "preempt":
        preempt(args.workspace, async_save=bool(args.max_steps))
        return
    hooks = [ReportHook(sleep=0.05), CheckpointingHook(interval=1_000_000, exit_signals=["SIGTERM"])]
    TinyTrainer(max_steps=args.max_steps, workspace=args.workspace, hooks=hooks).train()


if __name__ == "__main__":
    main()
