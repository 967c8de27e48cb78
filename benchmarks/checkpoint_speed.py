"""Checkpoints against plain ``torch.save`` / ``torch.load`` of the same state, and the disk itself.

The state: an MLP (two square layers) with AdamW after one step, so the optimizer holds two
moments per parameter: about ``--sizes`` MB in all. Per round, interleaved, each pair in the
same conditions:

- **disk**: write the state's bytes to a file and fsync it; read them back.
- **save**: ``torch.save`` of ``model.pt`` and ``training_state.pt`` + fsync of each (the
  floor) against ``write_checkpoint`` (hashes, manifest, atomic rename, ``latest``).
- **resume**: ``torch.load(weights_only=True)`` of both files + ``model.load_state_dict`` +
  ``optimizer.load_state_dict`` (the floor) against trainloop's resume (rank 0 lists the
  checkpoint; every file read once, verified as it is read; model and optimizer loaded), and
  against the previous resume (verify every file in a pass, then ``read_checkpoint``, then
  torch's ``set_state_dict``). ``cold``: the files are first dropped from the page cache
  (``posix_fadvise(DONTNEED)``), so they come from the disk; ``warm``: from the page cache.
- **async**: a background save (``CheckpointManager(async_save=True)``) between training steps:
  how long the loop is blocked (the save call, plus the next optimizer step's wait for the
  background copy of parameters and optimizer state), and the process's memory (RSS) above
  what it was before the save: its peak during the save (beside a step's own peak without a
  save: gradients and the optimizer's temporaries), and what is left once it is settled.

Medians over ``--rounds`` rounds (the first round of each size is a warm-up, not counted).
Wall-clock time; the machine's other load shows as noise, hence the pairs.

Run: ``python benchmarks/checkpoint_speed.py [--sizes 50 200] [--rounds 5] [--dir DIR]``
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainloop.checkpoint.files import read_checkpoint
from trainloop.checkpoint.manager import CheckpointManager, write_checkpoint
from trainloop.checkpoint.manifest import verify_checkpoint
from trainloop.checkpoint.verify import open_checkpoint
from trainloop.core.training_state import _load_model_and_optimizer


def build(megabytes: float) -> tuple[nn.Module, torch.optim.Optimizer]:
    """An MLP and its AdamW after one step: about ``megabytes`` MB of state (3 floats a parameter)."""
    width = int((megabytes * 1e6 / 12 / 2) ** 0.5)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step(model, optimizer)
    return model, optimizer


def step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    width = model[0].in_features
    model(torch.randn(8, width)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The layout a trainer checkpoints (``get_state_dict``: optimizer state keyed by names)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "training_state": {"step": 1, "epoch": 0, "optimizer": optimizer_state}}


def fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def drop_cache(directory: Path) -> None:
    """Evict ``directory``'s files from the page cache (they were fsynced: clean pages)."""
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class Shim:
    """What the resume functions read of a trainer."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer, self.state_dict_options = model, optimizer, None


def rss() -> int:
    with open("/proc/self/statm") as file:
        return int(file.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRss:
    """The highest RSS seen while in the block (sampled every 2 ms on a thread)."""

    def __enter__(self) -> PeakRss:
        self.peak, self._stop = rss(), threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, rss())

    def __exit__(self, *_: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())


def staged_bytes(manager: CheckpointManager) -> int:
    """The bytes of the staging buffers ``manager`` holds."""
    return sum(t.numel() * t.element_size() for t in manager._stage._buffers.values())


def one_round(scratch: Path, megabytes: float, results: dict[str, list[float]]) -> float:
    model, optimizer = build(megabytes)
    state = state_dict(model, optimizer)
    native = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    size = sum(t.numel() * t.element_size() for t in [*model.state_dict().values(),
               *(v for s in optimizer.state.values() for v in s.values() if v.dim())])
    blob = bytes(size)

    raw = scratch / "raw.bin"

    def disk_write() -> None:
        with open(raw, "wb") as file:
            file.write(blob)
        fsync(raw)

    def disk_read() -> None:
        with open(raw, "rb", buffering=0) as file:
            file.read()

    plain, ours_root = scratch / "plain", scratch / "ours"

    def plain_save() -> None:
        plain.mkdir(exist_ok=True)
        for name, value in (("model.pt", native["model"]), ("training_state.pt", native["optimizer"])):
            torch.save(value, plain / name)
            fsync(plain / name)

    def our_save() -> None:
        write_checkpoint(ours_root, 1, state)

    results["disk write"].append(timed(disk_write))
    results["torch.save + fsync"].append(timed(plain_save))
    results["write_checkpoint"].append(timed(our_save))
    checkpoint = ours_root / "1"

    def plain_resume() -> None:
        model.load_state_dict(torch.load(plain / "model.pt", weights_only=True))
        optimizer.load_state_dict(torch.load(plain / "training_state.pt", weights_only=True))

    def our_resume() -> None:
        chosen = open_checkpoint([checkpoint], explicit=True)
        assert chosen is not None
        assert chosen[1] is not None
        loaded = chosen[1]
        _load_model_and_optimizer(Shim(model, optimizer), loaded["model"], loaded["training_state"]["optimizer"])  # type: ignore[arg-type]

    def previous_resume() -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        verify_checkpoint(checkpoint)
        loaded = read_checkpoint(checkpoint, verify=False)
        set_state_dict(model, optimizer, model_state_dict=loaded["model"],
                       optim_state_dict=loaded["training_state"]["optimizer"])

    for temperature in ("cold", "warm"):
        for name, fn, directory in (
            ("disk read", disk_read, scratch),
            ("torch.load + load_state_dict", plain_resume, plain),
            ("trainloop resume", our_resume, checkpoint),
            ("previous resume", previous_resume, checkpoint),
        ):
            if temperature == "cold":
                drop_cache(directory)
            else:
                fn()  # into the page cache
            results[f"{name} ({temperature})"].append(timed(fn))

    # Background save: blocked time and memory above the baseline.
    manager = CheckpointManager(ours_root, "full", async_save=True, logger=logging.getLogger("bench"))
    shutil.rmtree(ours_root)
    step(model, optimizer)
    before = rss()
    with PeakRss() as step_peak:  # a step's own memory (gradients, the optimizer's temporaries)
        step(model, optimizer)
    results["async: a step's own peak RSS above before (MB)"].append((step_peak.peak - before) / 1e6)
    state_dict(model, optimizer)  # as before the save below (torch builds the dict's state lazily)
    before = rss()
    with PeakRss() as peak:
        waited = manager.waited
        started = time.perf_counter()
        manager.save(2, state_dict(model, optimizer), [optimizer])
        blocked = time.perf_counter() - started
        held = staged_bytes(manager)
        step(model, optimizer)  # waits for the background copy of parameters and moments
        blocked += manager.waited - waited
        error = manager.settle(agree=False)
    assert error is None, error
    results["async: loop blocked"].append(blocked)
    results["async: peak RSS above before (MB)"].append((peak.peak - before) / 1e6)
    results["async: RSS left after the save (MB)"].append((rss() - before) / 1e6)
    results["async: staging copy during the save (MB)"].append(held / 1e6)
    results["async: staging copy kept after it (MB)"].append(staged_bytes(manager) / 1e6)
    manager.close()
    for path in (plain, ours_root, raw):
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    return size / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[50, 200], help="state sizes, MB")
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds per size")
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    logging.getLogger("trainloop").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}; medians of {args.rounds} interleaved rounds; wall clock")
    with tempfile.TemporaryDirectory(dir=args.dir) as scratch:
        for megabytes in args.sizes:
            results: dict[str, list[float]] = {}
            for round_ in range(args.rounds + 1):
                current: dict[str, list[float]] = {key: [] for key in (
                    "disk write", "torch.save + fsync", "write_checkpoint", "async: loop blocked",
                    "async: peak RSS above before (MB)", "async: a step's own peak RSS above before (MB)",
                    "async: RSS left after the save (MB)",
                    "async: staging copy during the save (MB)", "async: staging copy kept after it (MB)")}
                current.update({f"{n} ({t})": [] for t in ("cold", "warm") for n in (
                    "disk read", "torch.load + load_state_dict", "trainloop resume", "previous resume")})
                size = one_round(Path(scratch), megabytes, current)
                if round_ > 0:  # the first is a warm-up
                    for key, values in current.items():
                        results.setdefault(key, []).extend(values)
            report(size, results)


def report(size: float, results: dict[str, list[float]]) -> None:
    med = {key: statistics.median(values) for key, values in results.items()}

    def ratio(key: str, floor: str) -> str:
        return f"{statistics.median(a / b for a, b in zip(results[key], results[floor], strict=True)):.2f}×"

    print(f"\nstate {size:.0f} MB")
    print(f"  {'disk write + fsync':<40} {1000 * med['disk write']:>7.0f} ms")
    print(f"  {'torch.save + fsync':<40} {1000 * med['torch.save + fsync']:>7.0f} ms")
    print(f"  {'write_checkpoint (sync save)':<40} {1000 * med['write_checkpoint']:>7.0f} ms   "
          f"{ratio('write_checkpoint', 'torch.save + fsync')} torch.save + fsync (paired)")
    for temperature in ("cold", "warm"):
        floor = f"torch.load + load_state_dict ({temperature})"
        print(f"  {'disk read (' + temperature + ')':<40} {1000 * med[f'disk read ({temperature})']:>7.0f} ms")
        print(f"  {floor:<40} {1000 * med[floor]:>7.0f} ms")
        for name in ("trainloop resume", "previous resume"):
            key = f"{name} ({temperature})"
            print(f"  {key:<40} {1000 * med[key]:>7.0f} ms   {ratio(key, floor)} the floor (paired)")
    blocked = med["async: loop blocked"]
    share = statistics.median(
        a / b for a, b in zip(results["async: loop blocked"], results["write_checkpoint"], strict=True)
    )
    print(f"  {'async save: loop blocked':<40} {1000 * blocked:>7.1f} ms   {100 * share:.1f}% of a sync save (paired)")
    print(f"  {'async save: staging copy held':<40} {med['async: staging copy during the save (MB)']:>7.0f} MB during, "
          f"{med['async: staging copy kept after it (MB)']:.0f} MB once settled")
    own = med["async: a step's own peak RSS above before (MB)"]
    print(f"  {'async save: peak RSS above before':<40} {med['async: peak RSS above before (MB)']:>7.0f} MB "
          f"(a step alone: {own:.0f} MB)")
    print(f"  {'async save: RSS left once settled':<40} {med['async: RSS left after the save (MB)']:>7.0f} MB")


if __name__ == "__main__":
    main()
