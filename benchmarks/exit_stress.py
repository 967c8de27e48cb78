"""Do DDP processes exit cleanly? Many short multi-rank runs, each ending by a signal or normally.

Each run starts ``--world`` processes as torchrun would (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR=127.0.0.1``...; gloo on the loopback interface). Every process joins the group
with ``init_distributed()``, trains a small DDP model with a ``CheckpointingHook`` (full or
sharded format, whose object collectives used to make exit crashes more likely) and leaves the
``with`` block. Half the runs end normally (exit 0 expected); in the other half rank 0 gets a
SIGTERM mid-run (exit 143 expected on every rank). Anything else, a SIGABRT
("terminate called without an active exception"), a SIGSEGV or a hang, is a crash.

Run: ``python benchmarks/exit_stress.py [--runs 30] [--world 2] [--format full] [--spawn]``
(``--world 2 4`` runs both sizes). Prints one line per run and the tally; exits 1 on any crash.
The ranks are forked from this process once it imported torch (each still ends the way a
script does, through the interpreter's shutdown); ``--spawn`` starts fresh interpreters
instead, slower. To debug a crash, ``EXIT_STRESS_CORES=<dir>`` makes the ranks dump core
there (``EXIT_STRESS_FAULTHANDLER=1`` also prints Python's stacks).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
EXPECTED = {"normal": 0, "signal": 128 + signal.SIGTERM}


def worker(workspace: str, max_steps: int, format: str) -> None:
    """One rank: init_distributed, a DDP run with checkpoints, then leave the block."""
    import torch
    from torch import nn

    from trainloop import BaseHook, BaseTrainer
    from trainloop.distributed import init_distributed, wrap_model
    from trainloop.hooks.checkpointing import CheckpointingHook

    torch.set_num_threads(1)
    if os.environ.get("EXIT_STRESS_CORES"):  # to debug a crash: core files there, for gdb
        import faulthandler
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        os.chdir(os.environ["EXIT_STRESS_CORES"])
        if os.environ.get("EXIT_STRESS_FAULTHANDLER"):
            faulthandler.enable()

    ready_fd = int(os.environ.get("READY_FD", "-1"))

    class Ready(BaseHook):
        """Tells the parent that training runs (then it may signal), on rank 0."""

        def on_after_step(self, trainer):
            if trainer.step == 3 and ready_fd >= 0:
                os.write(ready_fd, b"ready\n")
            time.sleep(0.01)

    class Trainer(BaseTrainer):
        def build_data_loader(self):
            g = torch.Generator().manual_seed(0)
            return [(torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)) for _ in range(8)]

        def build_model(self):
            torch.manual_seed(0)
            return wrap_model(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1)), "ddp")

        def build_optimizer(self):
            return torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)

        def build_hooks(self):
            return [Ready(), CheckpointingHook(interval=5, format=format, exit_signals=["SIGTERM"])]

        def forward(self, batch):
            x, y = batch
            loss = nn.functional.mse_loss(self.model(x), y)
            return loss, {}

    with init_distributed(backend="gloo", device="cpu"):
        Trainer(max_steps=max_steps, workspace=workspace).train()


def run_once(world: int, how: str, format: str, tmp: Path, port: int, fork: bool) -> list[int | None]:
    """One run of ``world`` processes; their exit codes (None: hung and killed)."""
    max_steps = 20 if how == "normal" else 100_000
    ready_read, ready_write = os.pipe()
    pids = []
    for rank in range(world):
        env = dict(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
        if fork:
            pid = os.fork()
            if pid == 0:  # the rank: a real process that ends the way a script does
                os.close(ready_read)
                os.environ.update(env)
                os.environ["READY_FD"] = str(ready_write if rank == 0 and how == "signal" else -1)
                worker(str(tmp), max_steps, format)
                raise SystemExit(0)  # unwinds to the top: the interpreter finalises as usual
        else:
            pid = subprocess.Popen(
                [sys.executable, str(HERE), "--worker", str(tmp), str(max_steps), format],
                env={**os.environ, **env, "READY_FD": str(ready_write if rank == 0 and how == "signal" else -1)},
                pass_fds=(ready_write,),
            ).pid
        pids.append(pid)
    os.close(ready_write)
    if how == "signal":
        with os.fdopen(ready_read) as ready:
            if ready.readline().strip() == "ready":
                os.kill(pids[0], signal.SIGTERM)
    else:
        os.close(ready_read)
    deadline = time.monotonic() + 120
    codes: list[int | None] = [None] * world
    while any(code is None for code in codes) and time.monotonic() < deadline:
        for i, pid in enumerate(pids):
            if codes[i] is None:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[i] = os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    for i, pid in enumerate(pids):
        if codes[i] is None:  # hung
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    return codes


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], int(sys.argv[3]), sys.argv[4])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--runs", type=int, default=30, help="runs per world size")
    parser.add_argument("--world", type=int, nargs="+", default=[2])
    parser.add_argument("--format", choices=["full", "sharded"], default="full")
    parser.add_argument("--spawn", action="store_true",
                        help="start each rank as a new interpreter (slower: each imports torch)")
    args = parser.parse_args()
    if not args.spawn:  # every import done once, before forking
        import torch

        import trainloop.hooks.checkpointing  # noqa: F401
        from trainloop.checkpoint import manager  # noqa: F401

        torch.set_num_threads(1)
    crashes = 0
    total = 0
    for world in args.world:
        for i in range(args.runs):
            how = "signal" if i % 2 else "normal"
            tmp = Path(tempfile.mkdtemp())
            start = time.monotonic()
            codes = run_once(world, how, args.format, tmp, free_port(), fork=not args.spawn)
            shutil.rmtree(tmp, ignore_errors=True)
            bad = any(code != EXPECTED[how] for code in codes)
            crashes += bad
            total += 1
            print(f"world {world} run {i + 1:2d} {how:6s} exit codes {codes} "
                  f"{'CRASH' if bad else 'ok'} ({time.monotonic() - start:.1f} s)", flush=True)
    print(f"{crashes} of {total} runs crashed ({args.format} format)")
    sys.exit(1 if crashes else 0)


if __name__ == "__main__":
    main()
