"""A run stopped on 2 ranks resumes on 1 or 3 (and one on 1 process on 2) at the exact data position.

Real processes, gloo on the CPU, DDP, a ``DataLoader`` over a ``DistributedSampler`` (the setup
docs/distributed.md teaches), the global batch kept (12: 2 ranks x 6, 1 x 6 x 2 accumulated,
3 x 2 x 2). The dataset records the indices it is asked for. With 48 items every world size
splits every epoch alike, so the resumed run must draw each step's samples as the unbroken
2-rank run did and end with its weights; with 49, the sampler's ``drop_last`` matters, and the
rest of the interrupted epoch must be dealt out as a ``DistributedSampler`` deals an epoch
(padded or cut to a multiple of the new ranks), the later epochs being the new sampler's own.

Few processes, started together and reused (``reshard_worker.py`` runs several trainings
each): a 2-rank group stops every configuration and runs the references; one process
stops a single-process run; then, after a handshake, the single process resumes on 1 rank,
a 3-rank group on 3, and the 2-rank group resumes the single-process run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from child_process import ChildProcess
from cli_process import Cli
from cli_trainers import CliSettings, CliTrainer
from ddp_worker import free_port
from torch.utils.data import DistributedSampler

from trainloop.checkpoint import checkpoint_steps

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "support" / "reshard_worker.py"
EXAMPLE = ROOT / "examples" / "ddp" / "train.py"
TIMEOUT = 240
SEED = 7  # reshard_worker's: the sampler's and every process's
GLOBAL_BATCH = 12
# ranks -> (batch size, accumulation): the global batch kept
SHAPES = {1: (6, 2), 2: (6, 1), 3: (2, 2)}
# Even: 48 items, stopped mid-epoch 1 after step 6 (4 steps per epoch). Uneven: 49 items,
# stopped after step 7 (2 or 3 batches into epoch 1, as drop_last makes 5 or 4 steps of epoch 0).
EVEN = {"length": 48, "stop_at": 6, "max_steps": 12}
UNEVEN = {"length": 49, "stop_at": 7, "max_steps": 14}
# length, the sampler's shuffle and drop_last, the checkpoint's format: every even pair, and the
# uneven ones with each shuffle, each drop_last and each format twice.
CONFIGS = [
    *((48, shuffle, False, fmt) for shuffle in (True, False) for fmt in ("full", "sharded")),
    (49, True, False, "full"), (49, True, True, "sharded"), (49, False, False, "sharded"), (49, False, True, "full"),
]


def name(config: tuple[Any, ...]) -> str:
    length, shuffle, drop_last, fmt = config
    return f"{length}-{'shuffled' if shuffle else 'ordered'}-{'cut' if drop_last else 'padded'}-{fmt}"


def run(tmp: Path, label: str, ranks: int, config: tuple[Any, ...] | None = None, **more: Any) -> dict[str, Any]:
    """A run of one configuration on ``ranks`` ranks (its workspace and output named by ``label``)."""
    batch, accumulation = SHAPES[ranks]
    spec: dict[str, Any] = {"name": label, "workspace": str(tmp / label), "out": str(tmp / f"{label}.out"),
                            "batch": batch, "accumulation": accumulation, "loader": "distributed", "format": "full"}
    if config is not None:
        length, shuffle, drop_last, fmt = config
        spec.update(EVEN if length == 48 else UNEVEN)
        spec.update(shuffle=shuffle, drop_last=drop_last, format=fmt)
    return {**spec, **more}


def resume(tmp: Path, config: tuple[Any, ...], ranks: int, **more: Any) -> dict[str, Any]:
    """A resume on ``ranks`` ranks of a copy of the configuration's stopped workspace."""
    label = more.pop("label", f"{name(config)}-to{ranks}")
    return run(tmp, label, ranks, config, stop_at=None, copy_from=str(tmp / f"stop-{name(config)}"), **more)


def join(rank: int, world: int, port: int) -> dict[str, Any]:
    return {"join": {"rank": rank, "world": world, "port": port}}


def records(tmp: Path, label: str, ranks: int) -> list[dict[str, Any]]:
    return [torch.load(tmp / f"{label}.out.rank{rank}", weights_only=True) for rank in range(ranks)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, example_on_two_ranks):
    """Three processes: two stop every configuration on 2 ranks while the third stops a single-process run;
    the three resume on 3 ranks; then the third resumes on 1 rank while the two resume the single-process run."""
    tmp = tmp_path_factory.mktemp("reshard")
    two, three, two_again = free_port(), free_port(), free_port()
    plain = {"loader": "plain", "length": 48, "batch": 12, "accumulation": 1, "max_steps": 8}
    on_two = [
        *(run(tmp, f"reference-{shuffle}", 2, (48, shuffle, False, "full"), stop_at=None) for shuffle in (True, False)),
        *(run(tmp, f"stop-{name(config)}", 2, config) for config in CONFIGS),
    ]
    on_three = [
        resume(tmp, (48, True, False, "full"), 3, accumulation=1, refused=True, label="refused"),
        *(resume(tmp, config, 3) for config in CONFIGS),
    ]
    plain_on_two = run(tmp, "plain", 2, None, length=48, shuffle=True, drop_last=False, max_steps=8)
    plans = [
        [join(rank, 2, two), *on_two, join(rank, 3, three), *on_three, join(rank, 2, two_again), plain_on_two]
        for rank in (0, 1)
    ]
    plans.append([
        run(tmp, "plain-reference", 1, None, **plain),
        run(tmp, "plain", 1, None, **plain, stop_at=5, out=str(tmp / "plain-stop.out")),
        join(2, 3, three), *on_three, join(0, 1, 0), *(resume(tmp, config, 1) for config in CONFIGS),
    ])
    workers = [ChildProcess(WORKER, [json.dumps(process)], tmp) for process in plans]
    try:
        codes = [worker.finish(timeout=TIMEOUT) for worker in workers]
        assert codes == [0] * len(workers), "\n".join(worker.stderr()[-3000:] for worker in workers)
    finally:
        for worker in workers:
            if worker.proc.poll() is None:
                worker.proc.kill()
                worker.proc.wait()
    return tmp, workers


def steps(rank_records: list[dict[str, Any]]) -> dict[int, list[int]]:
    """Each step's samples over all ranks (sorted)."""
    found: dict[int, list[int]] = {}
    for record in rank_records:
        for step, _, indices in record["microsteps"]:
            found.setdefault(step, []).extend(indices)
    return {step: sorted(indices) for step, indices in found.items()}


def epoch_order(length: int, epoch: int, shuffle: bool) -> list[int]:
    """A DistributedSampler's global order, as documented: a permutation seeded with seed + epoch, or the range."""
    if not shuffle:
        return list(range(length))
    return torch.randperm(length, generator=torch.Generator().manual_seed(SEED + epoch)).tolist()


@pytest.mark.parametrize("ranks", [1, 3])
@pytest.mark.parametrize("config", [c for c in CONFIGS if c[0] == 48], ids=name)
def test_an_even_epoch_resumes_on_other_ranks_as_the_unbroken_run_went_on(runs, config, ranks):
    tmp, _ = runs
    reference = records(tmp, f"reference-{config[1]}", 2)
    stopped = records(tmp, f"stop-{name(config)}", 2)
    resumed = records(tmp, f"{name(config)}-to{ranks}", ranks)
    assert {r["started"] for r in resumed} == {6}
    assert {r["step"] for r in resumed} == {12}
    assert steps(stopped) == {s: v for s, v in steps(reference).items() if s <= 6}
    assert steps(resumed) == {s: v for s, v in steps(reference).items() if s > 6}  # the samples of each step
    for got, want in zip(resumed[0]["params"], reference[0]["params"], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)  # the reduction order differs


@pytest.mark.parametrize("ranks", [1, 3])
@pytest.mark.parametrize("config", [c for c in CONFIGS if c[0] == 49], ids=name)
def test_an_uneven_epoch_is_dealt_over_the_new_ranks_and_later_epochs_are_theirs(runs, config, ranks):
    tmp, _ = runs
    length, shuffle, drop_last, _ = config
    batch = SHAPES[ranks][0]
    stopped = records(tmp, f"stop-{name(config)}", 2)
    resumed = records(tmp, f"{name(config)}-to{ranks}", ranks)
    assert {r["started"] for r in resumed} == {7}
    assert {r["step"] for r in resumed} == {14}
    order = epoch_order(length, 1, shuffle)
    drawn = sorted(i for r in stopped for _, epoch, indices in r["microsteps"] if epoch == 1 for i in indices)
    consumed = 36 if drop_last else 24  # 3 or 2 batches of 6 on each of 2 ranks
    assert drawn == sorted(order[:consumed])

    # The rest of epoch 1, padded with its first samples or cut to a multiple of the ranks; each
    # microstep (over all ranks) draws the next chunk of it.
    rest = order[consumed:]
    rest = rest[: len(rest) - len(rest) % ranks] if drop_last else rest + rest[: -len(rest) % ranks]
    per_rank = [[indices for _, epoch, indices in r["microsteps"] if epoch == 1] for r in resumed]
    microsteps = [sorted(i for batches in per_rank for i in batches[j]) for j in range(len(per_rank[0]))]
    chunk = batch * ranks
    assert microsteps == [sorted(rest[j : j + chunk]) for j in range(0, len(rest), chunk)]
    assert Counter(drawn + [i for m in microsteps for i in m]) == Counter(order[:consumed] + rest)

    # Epoch 2 on: what the new ranks' own sampler draws.
    for rank, record in enumerate(resumed):
        later = [i for _, epoch, indices in record["microsteps"] if epoch >= 2 for i in indices]
        sampler = DistributedSampler(range(length), num_replicas=ranks, rank=rank, shuffle=shuffle, seed=SEED,
                                     drop_last=drop_last)
        expected = []
        for epoch in range(2, 4):
            sampler.set_epoch(epoch)
            expected += list(sampler)
        assert later
        assert later == expected[: len(later)]


def test_a_single_process_run_resumes_on_two_ranks_in_its_own_order(runs):
    tmp, _ = runs
    reference = records(tmp, "plain-reference", 1)
    stopped = records(tmp, "plain-stop", 1)
    resumed = records(tmp, "plain", 2)
    assert {r["started"] for r in resumed} == {5}
    assert {r["step"] for r in resumed} == {8}
    assert steps(stopped) == {s: v for s, v in steps(reference).items() if s <= 5}
    assert steps(resumed) == {s: v for s, v in steps(reference).items() if s > 5}
    for got, want in zip(resumed[0]["params"], reference[0]["params"], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_another_global_batch_is_refused_on_every_rank_before_the_first_step(runs):
    tmp, workers = runs
    for rank, worker in enumerate(workers):  # ranks 0, 1, 2 of the 3-rank group
        (line,) = [line for line in worker.lines if line.startswith(f"{rank} refused refused ")]
        assert line.endswith(
            "the checkpoint's global batch is 12 (2 ranks x batch size 6 x gradient_accumulation_steps 1) and this "
            "run's is 6 (3 ranks x batch size 2 x gradient_accumulation_steps 1): a resume must keep the global batch, "
            "so on 3 ranks set gradient_accumulation_steps=2 or build the data loader with batch_size=4, or start "
            "fresh (another workspace, or CheckpointingHook(load=None))"
        )
    assert checkpoint_steps(tmp / "refused" / "checkpoints") == [6]  # nothing saved
    assert not (tmp / "refused.out.rank0").exists()


def test_the_command_line_refuses_another_global_batch_in_one_line_and_writes_no_checkpoint(tmp_path):
    (tmp_path / "run.yaml").write_text("max_steps: 2\nworkspace: ws\nhooks:\n  - {type: checkpointing, interval: 2}\n")
    workspace = tmp_path / "ws"
    settings = CliSettings.from_file(tmp_path / "run.yaml").model_copy(update={"workspace": workspace})
    CliTrainer(settings).train()  # what `trainloop run run.yaml` trains, in this process
    kept = {path: path.read_bytes() for path in (workspace / "checkpoints").rglob("*") if path.is_file()}
    metrics = (workspace / "metrics.jsonl").read_bytes()
    recorded = (workspace / "settings.json").read_bytes()

    refused = Cli("run", "run.yaml", "--trainer", "cli_trainers:CliTrainer", "--set", "max_steps=4",
                  "--set", "gradient_accumulation_steps=2", cwd=tmp_path).result()
    assert refused.returncode == 2
    errors = [line for line in refused.stderr.splitlines() if line.startswith("trainloop run: error:")]
    assert errors == [
        "trainloop run: error: the checkpoint's global batch is 8 (1 rank x batch size 8 x gradient_accumulation_steps "
        "1) and this run's is 16 (1 rank x batch size 8 x gradient_accumulation_steps 2): a resume must keep the "
        "global batch, so on 1 rank set gradient_accumulation_steps=1 or build the data loader with batch_size=4, or "
        "start fresh (another workspace, or CheckpointingHook(load=None))"
    ]
    assert "Traceback" not in refused.stderr
    assert checkpoint_steps(workspace / "checkpoints") == [2]
    assert {path: path.read_bytes() for path in (workspace / "checkpoints").rglob("*") if path.is_file()} == kept
    assert (workspace / "metrics.jsonl").read_bytes() == metrics
    assert (workspace / "settings.json").read_bytes() == recorded  # the refused run's settings are not the run's
    runs = [json.loads(line) for line in (workspace / "runs.jsonl").read_text().splitlines()]
    assert [run["exit_code"] for run in runs] == [0]  # refused before its first step: not a run, not recorded


def example_env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


@pytest.fixture(scope="module")
def example_on_two_ranks(tmp_path_factory):
    """docs/distributed.md's first command, started at once (the other runs go on meanwhile): 40 steps on 2 ranks."""
    tmp = tmp_path_factory.mktemp("example")
    workspace = tmp / "runs" / "ddp"
    if importlib.util.find_spec("sklearn") is None:  # the example's data; its test skips
        yield workspace, None, None
        return
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(EXAMPLE), "--workspace", str(workspace), "--max-steps", "40"]
    with open(tmp / "stderr.txt", "w") as stderr:
        process = subprocess.Popen(command, env=example_env(), stdout=subprocess.DEVNULL, stderr=stderr)
    yield workspace, process, tmp / "stderr.txt"
    if process.poll() is None:
        process.kill()
        process.wait()


def test_the_docs_example_stopped_on_two_ranks_resumes_on_one_with_twice_the_accumulation(example_on_two_ranks):
    pytest.importorskip("sklearn")
    workspace, first, stderr = example_on_two_ranks
    assert first.wait(timeout=TIMEOUT) == 0, stderr.read_text()[-3000:]
    # docs/distributed.md's second command
    command = [sys.executable, str(EXAMPLE), "--workspace", str(workspace), "--max-steps", "60", "--accumulation", "2"]
    second = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT, env=example_env(), check=False)
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"Resumed from {workspace / 'checkpoints' / '40'} at step 40" in second.stderr
    assert "final accuracy" in second.stdout
    assert "after 60 steps on 1 ranks" in second.stdout
    assert "InexactResumeWarning" not in second.stderr
