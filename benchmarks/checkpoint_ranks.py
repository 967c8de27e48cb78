"""Checkpoints and exit agreement at 1, 2 and 4 ranks (gloo, DDP), against the disk's own floor.

Each rank holds the same DDP-wrapped MLP with AdamW after one step (about ``--size`` MB of
state, as in ``checkpoint_speed.py``). Per round, interleaved, every rank in step (a barrier
before each measurement; the time of a measurement is the slowest rank's):

- **save**: the floor, rank 0's ``torch.save`` + fsync of the model's and the optimizer's state
  dicts (what a hand-written DDP loop does), against ``CheckpointManager`` writing the full format
  (rank 0 writes; hashes, manifest, atomic rename, ``latest``, the ranks agreeing on the outcome)
  and the sharded one (every rank writes its shard through DCP), which is also put beside the
  sharded format's own floor, a plain ``dcp.save`` of the same state.
- **resume**: the floor, every rank's ``torch.load(weights_only=True)`` of both files +
  ``load_state_dict``, against trainloop's resume of the full checkpoint (every rank reads each
  file once, verified as read) and of the sharded one (each rank verifies its share and DCP
  reads through it), which is also put beside a plain ``dcp.load`` of the same state into the
  live tensors (what a hand-written DCP loop does). Warm: the files are in the page cache (one
  machine, every rank reading the same files: a cold read would be one rank's, the others
  hitting the cache).
- **async**: a background full save between steps: how long the loop is blocked (the save
  call, plus the next optimizer step's wait for the background copy), and rank 0's peak RSS
  above what it was before the save.
- **agreement**: a tiny DDP model's steps (``--steps``) with no exit agreement, with the
  agreement on every step (``ExitAgreement(max_every=1)``, as before), and as it is: time per
  step (CPU-bound, so process time of rank 0) and collectives started per step.

The load average is printed with each table: the machine may be shared.

Run: ``python benchmarks/checkpoint_ranks.py [--ranks 1 2 4] [--size 50] [--rounds 5] [--dir DIR]``
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from checkpoint_speed import PeakRss, Shim, build, fsync, rss, step
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from trainloop.checkpoint.loading import VerifiedFiles
from trainloop.checkpoint.manager import CheckpointManager
from trainloop.checkpoint.sharded import load_sharded
from trainloop.checkpoint.verify import open_checkpoint
from trainloop.core.training_state import _load_model_and_optimizer
from trainloop.distributed.agreement import ExitAgreement


def state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, sharded: bool = False) -> dict[str, Any]:
    """The layout a trainer checkpoints."""
    options = StateDictOptions(full_state_dict=not sharded)
    model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
    return {"model": model_state, "training_state": {"step": 1, "epoch": 0, "optimizer": optimizer_state}}


def timed_on_all(fn: Callable[[], Any]) -> float:
    """The slowest rank's time for ``fn`` (every rank starts together)."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return float(took)


def one_round(
    scratch: Path,
    model: nn.parallel.DistributedDataParallel,
    optimizer: torch.optim.Optimizer,
    out: dict[str, list[float]],
) -> None:
    rank = dist.get_rank()
    logger = logging.getLogger("bench")
    plain, full, sharded, plain_dcp = scratch / "plain", scratch / "full", scratch / "sharded", scratch / "dcp"
    shim = Shim(model, optimizer)

    def plain_save() -> None:
        if rank == 0:
            plain.mkdir(exist_ok=True)
            for name, value in (("model.pt", model.state_dict()), ("optimizer.pt", optimizer.state_dict())):
                torch.save(value, plain / name)
                fsync(plain / name)
        dist.barrier()  # the others wait for it, as they would to go on together

    def our_save(root: Path, format: str) -> Callable[[], None]:
        def save() -> None:
            manager = CheckpointManager(root, format, async_save=False, logger=logger)
            error = manager.save(1, state_dict(model, optimizer, format == "sharded"))
            assert error is None, error
        return save

    out["save: torch.save + fsync (rank 0)"].append(timed_on_all(plain_save))
    out["save: trainloop full"].append(timed_on_all(our_save(full, "full")))
    out["save: trainloop sharded"].append(timed_on_all(our_save(sharded, "sharded")))

    def dcp_save() -> None:
        shutil.rmtree(plain_dcp, ignore_errors=True)
        dist.barrier()
        dcp.save(state_dict(model, optimizer, sharded=True), storage_writer=dcp.FileSystemWriter(plain_dcp))

    out["save: dcp.save (the sharded floor)"].append(timed_on_all(dcp_save))

    def plain_resume() -> None:
        model.load_state_dict(torch.load(plain / "model.pt", weights_only=True))
        optimizer.load_state_dict(torch.load(plain / "optimizer.pt", weights_only=True))

    def full_resume() -> None:
        chosen = open_checkpoint([full / "1"], explicit=True)
        assert chosen is not None
        assert isinstance(chosen[1], dict)
        loaded = chosen[1]
        _load_model_and_optimizer(shim, loaded["model"], loaded["training_state"]["optimizer"])  # type: ignore[arg-type]

    def sharded_resume() -> None:
        chosen = open_checkpoint([sharded / "1"], explicit=True)
        assert chosen is not None
        assert isinstance(chosen[1], VerifiedFiles)
        try:
            loaded = load_sharded(sharded / "1", state_dict(model, optimizer, sharded=True), chosen[1])
        finally:
            chosen[1].close()
        _load_model_and_optimizer(shim, loaded["model"], loaded["training_state"]["optimizer"])  # type: ignore[arg-type]

    def dcp_resume() -> None:
        dcp.load(state_dict(model, optimizer, sharded=True), storage_reader=dcp.FileSystemReader(plain_dcp))

    for name, fn in (("torch.load + load_state_dict", plain_resume), ("trainloop full", full_resume),
                     ("trainloop sharded", sharded_resume), ("dcp.load (the sharded floor)", dcp_resume)):
        fn()  # warm: into the page cache
        out[f"resume: {name}"].append(timed_on_all(fn))

    manager = CheckpointManager(full, "full", async_save=True, logger=logger)
    shutil.rmtree(full, ignore_errors=True)
    step(model.module, optimizer)
    dist.barrier()
    before = rss()
    with PeakRss() as peak:
        waited = manager.waited
        started = time.perf_counter()
        manager.save(2, state_dict(model, optimizer), [optimizer])
        blocked = time.perf_counter() - started
        step(model.module, optimizer)  # waits for the background copy of parameters and moments
        blocked += manager.waited - waited
        error = manager.settle(agree=True)
    assert error is None, error
    manager.close()
    worst = torch.tensor([blocked], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    out["async: loop blocked"].append(float(worst))
    out["async: rank 0 peak RSS above before (MB)"].append((peak.peak - before) / 1e6)
    dist.barrier()
    if rank == 0:
        for path in (plain, full, sharded):
            shutil.rmtree(path, ignore_errors=True)
    dist.barrier()


def agreement_round(steps: int, out: dict[str, list[float]]) -> None:
    """Per-step process time of a tiny DDP model: no agreement, one per step, as it is."""
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(16, 32), torch.randn(16, 1)
    for name, make in (("none", lambda: None), ("every step (before)", lambda: ExitAgreement(max_every=1)),
                       ("as it is", ExitAgreement)):
        agreement = make()
        dist.barrier()
        start = time.process_time()
        for _ in range(steps):
            loss = (model(x) - y).square().mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if agreement is not None:
                agreement.settle(0)
        if agreement is not None:
            agreement.close()
        out.setdefault(f"agreement {name}: ms per step", []).append((time.process_time() - start) / steps * 1e3)
        collectives = agreement.started / steps if agreement is not None else 0.0
        out.setdefault(f"agreement {name}: collectives per step", []).append(collectives)


def worker(rank: int, world: int, port: int, args: argparse.Namespace, scratch: str, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    logging.getLogger("trainloop").setLevel(logging.WARNING)
    model, optimizer = build(args.size)
    model = nn.parallel.DistributedDataParallel(model)
    results: dict[str, list[float]] = {}
    for round_ in range(args.rounds + 1):
        current: dict[str, list[float]] = {}
        for key in ("save: torch.save + fsync (rank 0)", "save: trainloop full", "save: trainloop sharded",
                    "save: dcp.save (the sharded floor)", "resume: torch.load + load_state_dict",
                    "resume: trainloop full", "resume: trainloop sharded", "resume: dcp.load (the sharded floor)",
                    "async: loop blocked", "async: rank 0 peak RSS above before (MB)"):
            current[key] = []
        one_round(Path(scratch), model, optimizer, current)
        agreement_round(args.steps, current)
        if round_ > 0:  # the first is a warm-up
            for key, values in current.items():
                results.setdefault(key, []).extend(values)
    if rank == 0:
        queue.put(results)
    dist.barrier()
    dist.destroy_process_group()


def report(world: int, results: dict[str, list[float]], load: tuple[float, float]) -> None:
    med = {key: statistics.median(values) for key, values in results.items()}

    def ratio(key: str, floor: str) -> str:
        return f"{statistics.median(a / b for a, b in zip(results[key], results[floor], strict=True)):.2f}×"

    save_floor, resume_floor = "save: torch.save + fsync (rank 0)", "resume: torch.load + load_state_dict"
    print(f"\n{world} rank(s); load average {load[0]:.1f} before, {load[1]:.1f} after")
    sharded_floors = {"save: trainloop sharded": "save: dcp.save (the sharded floor)",
                      "resume: trainloop sharded": "resume: dcp.load (the sharded floor)"}
    for key, value in med.items():
        if key in sharded_floors:
            floor = save_floor if key.startswith("save:") else resume_floor
            print(f"  {key:45s} {value * 1e3:8.0f} ms  {ratio(key, floor)} the floor, "
                  f"{ratio(key, sharded_floors[key])} the sharded floor")
        elif key.startswith("save:") and key != save_floor:
            print(f"  {key:45s} {value * 1e3:8.0f} ms  {ratio(key, save_floor)} the floor")
        elif key.startswith("resume:") and key != resume_floor:
            print(f"  {key:45s} {value * 1e3:8.0f} ms  {ratio(key, resume_floor)} the floor")
        elif key == "async: loop blocked":
            print(f"  {key:45s} {value * 1e3:8.1f} ms  {ratio(key, 'save: trainloop full')} of a sync save")
        elif key.endswith("(MB)"):
            print(f"  {key:45s} {value:8.0f} MB")
        elif key.endswith("ms per step"):
            print(f"  {key:45s} {value:8.3f} ms")
        elif key.endswith("collectives per step"):
            print(f"  {key:45s} {value:8.3f}")
        else:
            print(f"  {key:45s} {value * 1e3:8.0f} ms")
    none = "agreement none: ms per step"
    for name in ("every step (before)", "as it is"):
        print(f"  agreement {name}: per step vs none {ratio(f'agreement {name}: ms per step', none)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4], help="world sizes")
    parser.add_argument("--size", type=float, default=50, help="state size, MB")
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds")
    parser.add_argument("--steps", type=int, default=300, help="tiny steps per agreement measurement")
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    print(f"torch {torch.__version__}; {args.size:g} MB of state; medians of {args.rounds} interleaved rounds")
    context = mp.get_context("spawn")
    for world in args.ranks:
        with tempfile.TemporaryDirectory(dir=args.dir) as scratch, socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
            probe.close()
            load_before = os.getloadavg()[0]
            queue = context.Queue()
            procs = [context.Process(target=worker, args=(r, world, port, args, scratch, queue)) for r in range(world)]
            for proc in procs:
                proc.start()
            results = queue.get()
            for proc in procs:
                proc.join()
            report(world, results, (load_before, os.getloadavg()[0]))


if __name__ == "__main__":
    main()
