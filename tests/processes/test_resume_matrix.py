"""The resume matrix: for a product of features, a run stopped at a point and resumed from its
checkpoint trains on the same samples at every step and ends with the weights, optimizer state,
schedulers, grad scaler, EMA and generator ``torch.equal`` to the unbroken run's
(tests/support/resume_matrix.py builds and compares the runs).

By default a fixed sample runs: every value of every axis, every pair of values of two axes
(the in-process axes: ``SAMPLE`` is a pairwise covering array), a few one-feature cases that
pin a divergence on its cause, and a few runs on 2 gloo ranks and from 2 ranks onto 1. DeepSpeed
(the formats ``zero1`` and ``zero3``) joins on 2 ranks where ``deepspeed_refuses`` finds nothing
(the rule beside ``AXES``), and its other combinations run in tests/distributed/test_deepspeed.py.
``TRAINLOOP_MATRIX=all python -m pytest -m matrix -n 2 tests/processes/test_resume_matrix.py``
runs the whole product instead (see docs/checkpointing.md).

Stops: the stopped run saves at its stop step (the hook's interval) and asks to exit there; a
``signal`` stop is a real SIGTERM to a child process blocked in ``forward`` in the middle of
the stop step's accumulation (the step finishes and is saved, exit code 143). The resume always
runs in this process, a new one.

A combination that diverges today is listed in ``KNOWN_DIVERGENT`` with its cause and runs as a
strict xfail: when its fix merges, the case passes, the xfail fails, and its entry goes.
``known_cause`` says the same for the whole product, by rule.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from child_process import ChildProcess
from ddp_worker import free_port
from resume_matrix import AXES, Case, case_dict, deepspeed_refuses, divergences, train
from s3_server import s3  # noqa: F401  # the fixture

pytestmark = pytest.mark.matrix

SCRIPT = Path(__file__).resolve().parents[1] / "support" / "resume_matrix.py"
TIMEOUT = 300

#: A pairwise covering array over every axis but ``ranks`` (each pair of values of two axes in
#: at least one case), then one-feature cases beside the default one.
SAMPLE = [
    "one-full-local-epoch_end-acc1-mean-fp32-noema-constant-steps-finite-r1",
    "several-full_async-memory-mid_epoch-acc3-mean-bf16-ema-warmup_cosine-epochs-nan-r1",
    "fused-sharded-s3-epoch_start-acc1-items-fp16-ema-constant-epochs-nan-r1",
    "several-sharded_async-s3-signal-acc3-items-fp16-noema-warmup_cosine-steps-finite-r1",
    "fused-full_async-memory-mid_epoch-acc1-items-bf16-noema-constant-steps-finite-r1",
    "one-full-local-signal-acc3-items-fp32-ema-warmup_cosine-epochs-nan-r1",
    "fused-sharded-local-epoch_start-acc3-mean-fp32-noema-warmup_cosine-steps-finite-r1",
    "one-sharded_async-s3-epoch_end-acc1-mean-bf16-ema-warmup_cosine-epochs-finite-r1",
    "several-sharded_async-memory-epoch_end-acc3-items-fp32-noema-constant-steps-nan-r1",
    "one-sharded-memory-signal-acc1-mean-fp16-ema-constant-steps-finite-r1",
    "several-full-local-mid_epoch-acc1-mean-fp16-noema-constant-epochs-finite-r1",
    "one-full_async-s3-mid_epoch-acc1-mean-fp32-noema-constant-steps-finite-r1",
    "fused-full-memory-epoch_start-acc1-mean-bf16-noema-constant-steps-finite-r1",
    "fused-full_async-local-signal-acc1-mean-bf16-noema-constant-steps-finite-r1",
    "fused-full_async-local-epoch_end-acc1-mean-fp16-noema-constant-steps-finite-r1",
    "several-sharded-local-mid_epoch-acc1-mean-bf16-noema-constant-steps-finite-r1",
    "one-sharded_async-local-epoch_start-acc1-mean-fp32-noema-constant-steps-finite-r1",
    "fused-sharded_async-local-mid_epoch-acc1-mean-fp32-noema-constant-steps-finite-r1",
    "several-full-s3-epoch_start-acc1-mean-fp32-noema-constant-steps-finite-r1",
    "one-full_async-local-epoch_start-acc1-mean-fp32-noema-constant-steps-finite-r1",
    "one-sharded-local-epoch_end-acc1-mean-fp32-noema-constant-steps-finite-r1",
    # one feature each, beside the default case (its first line)
    "one-full-local-mid_epoch-acc1-mean-fp32-noema-constant-steps-finite-r1",
    "one-full-local-mid_epoch-acc1-mean-fp32-noema-constant-steps-nan-r1",
    "fused-full-local-mid_epoch-acc1-mean-fp32-noema-constant-steps-nan-r1",
    "several-sharded-local-mid_epoch-acc1-mean-fp32-noema-constant-steps-finite-r1",
    "one-full-local-mid_epoch-acc3-items-fp32-noema-constant-epochs-finite-r1",
    # 2 gloo ranks, and 2 ranks resumed on 1
    "one-full-local-mid_epoch-acc1-mean-fp32-noema-constant-steps-finite-r2",
    "one-sharded-local-epoch_end-acc1-mean-fp32-noema-constant-steps-finite-r2",
    "one-sharded-local-epoch_start-acc1-mean-fp32-ema-constant-steps-finite-r2",
    "one-sharded-local-mid_epoch-acc1-mean-fp32-noema-constant-steps-finite-r2to1",
    # DeepSpeed on 2 gloo ranks, where tests/distributed/test_deepspeed.py's resumes do not go: this harness's
    # data and SGD, a warmup, max_epochs, accumulation 3, a stop at an epoch's first step
    "one-zero1-local-epoch_start-acc3-mean-bf16-ema-warmup_cosine-epochs-nan-r2",
    "one-zero3-local-mid_epoch-acc1-mean-fp32-noema-constant-steps-finite-r2",
]

#: The cases of ``SAMPLE`` that diverge from their unbroken run, and why: none now. A defect found
#: goes here (a strict xfail) with its cause until its fix lands.
KNOWN_DIVERGENT: dict[str, str] = {}


def known_cause(case: Case, unbroken: dict[str, Any]) -> tuple[str, bool] | None:
    """Why ``case`` diverges from its unbroken run today, and whether it must (``None``: it must
    not): the rules behind ``KNOWN_DIVERGENT``, for the whole product."""
    return None


def product() -> list[Case]:
    """Every combination of the in-process axes on one rank, and the rank cases of ``SAMPLE``."""
    axes = {name: values for name, values in AXES.items() if name != "ranks"}
    cases = [Case(**dict(zip(axes, values))) for values in itertools.product(*axes.values())]
    cases = [case for case in cases if deepspeed_refuses(case) is None]  # DeepSpeed: on 2 ranks only
    return cases + [Case.from_id(i) for i in SAMPLE if not i.endswith("-r1")]


WHOLE = os.environ.get("TRAINLOOP_MATRIX") == "all"


def selected() -> list[Case]:
    """The sample, or the whole product under ``TRAINLOOP_MATRIX=all``."""
    return product() if WHOLE else [Case.from_id(i) for i in SAMPLE]


def param(case: Case) -> Any:
    """The sample's known divergences are strict xfails; the whole product's are decided by
    ``known_cause`` once the unbroken run is known (see ``check``)."""
    cause = None if WHOLE else KNOWN_DIVERGENT.get(case.id)
    marks = [pytest.mark.xfail(strict=True, reason=cause)] if cause else []
    return pytest.param(case, id=case.id, marks=marks)


def check(case: Case, unbroken: dict[str, Any], found: list[str]) -> None:
    """Fail with what differs; in the whole product, a case ``known_cause`` explains is an
    xfail when it diverges and, where the rule says it must, a failure when it no longer does
    (the rule must go)."""
    known = known_cause(case, unbroken) if WHOLE else None
    if known and found:
        pytest.xfail(known[0])
    if known and known[1]:
        pytest.fail(f"exact now, though known_cause says: {known[0]}")
    assert not found, "\n".join(found)


CASES = selected()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One thread, as the child processes: the same arithmetic in every process."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def roots(tmp_path_factory) -> dict[str, Path]:
    """A folder per case."""
    tmp = tmp_path_factory.mktemp("matrix")
    return {case.id: tmp / f"case{i}" for i, case in enumerate(CASES)}


def s3_target(case: Case, request: pytest.FixtureRequest) -> dict[str, Any] | None:
    """The case's own S3 bucket and the options to reach it (``None`` off S3)."""
    if case.storage != "s3":
        return None
    server = request.getfixturevalue("s3")
    return {"bucket": server.bucket(), "options": server.options}


def job(case: Case, root: Path, run: str, target: dict[str, Any] | None) -> dict[str, Any]:
    """A job of ``resume_matrix.py``: the unbroken run in a folder of its own, as in this process."""
    return {"case": case_dict(case), "root": str(root / "unbroken" if run == "unbroken" else root), "run": run,
            "record": str(root / run), "s3": target}


@pytest.fixture(scope="module")
def signal_child(tmp_path_factory) -> Iterator[ChildProcess]:
    """A child process that runs the stopped runs of the signal cases, one per line sent."""
    child = ChildProcess(SCRIPT, ["serve"], tmp_path_factory.mktemp("signal"))
    try:
        yield child
        child.proc.stdin.close()  # type: ignore[union-attr]
        assert child.finish(timeout=TIMEOUT) == 0, child.stderr()
    finally:
        if child.proc.poll() is None:
            child.proc.kill()
            child.proc.wait()


def signalled(child: ChildProcess, case: Case, root: Path, target: dict[str, Any] | None) -> dict[str, Any]:
    """The stopped run of a signal case, in ``child``: it blocks in the middle of its stop step's
    accumulation, gets a real SIGTERM, finishes the step, saves and exits the run (code 143)."""
    child.send(json.dumps(job(case, root, "stopped", target)))
    child.wait_for(f"paused {case.id}", timeout=TIMEOUT, exact=True)
    child.proc.send_signal(signal.SIGTERM)
    child.send("")
    child.wait_for(f"0 done {case.id} stopped", timeout=TIMEOUT)
    return torch.load(root / "stopped.rank0.pt", weights_only=False)  # our own record


@pytest.fixture(scope="module")
def on_two_ranks(roots, request, tmp_path_factory) -> dict[str, dict[str, Any]]:
    """The runs on 2 gloo ranks, in two child processes: each case's unbroken and stopped runs,
    and its resume where it resumes on 2 ranks. Records by case, run and rank."""
    cases = [case for case in CASES if case.world == 2]
    if not cases:
        return {}
    port = free_port()
    targets = {case.id: s3_target(case, request) for case in cases}
    jobs: list[list[dict[str, Any]]] = []
    for rank in range(2):
        plan: list[dict[str, Any]] = [{"join": {"rank": rank, "world": 2, "port": port}}]
        for case in cases:
            runs = ["unbroken", "stopped"] + (["resumed"] if case.ranks == "2" else [])
            plan += [job(case, roots[case.id], run, targets[case.id]) for run in runs]
        jobs.append(plan)
    tmp = tmp_path_factory.mktemp("ranks")
    # DeepSpeed's engine takes the children's gloo group, and asks for LOCAL_RANK as torchrun sets it.
    children = [ChildProcess(SCRIPT, [json.dumps(plan)], tmp, env={"DS_ACCELERATOR": "cpu", "LOCAL_RANK": str(rank)})
                for rank, plan in enumerate(jobs)]
    try:
        codes = [child.finish(timeout=TIMEOUT) for child in children]
        assert codes == [0, 0], "\n".join(child.stderr()[-3000:] for child in children)
    finally:
        for child in children:
            if child.proc.poll() is None:
                child.proc.kill()
                child.proc.wait()
    found: dict[str, dict[Any, Any]] = {}
    for case in cases:
        records = {
            (run, rank): torch.load(roots[case.id] / f"{run}.rank{rank}.pt", weights_only=False)  # our own records
            for run in ("unbroken", "stopped", "resumed") for rank in range(2)
            if (roots[case.id] / f"{run}.rank{rank}.pt").exists()
        }
        found[case.id] = {**records, "target": targets[case.id]}
    return found


def merged(draws: list[tuple[int, str, tuple[int, ...]]]) -> dict[tuple[int, str], list[int]]:
    """Each step's items per optimizer, over its microsteps (and ranks), sorted."""
    out: dict[tuple[int, str], list[int]] = {}
    for step, optimizer, items in draws:
        out.setdefault((step, optimizer), []).extend(items)
    return {key: sorted(items) for key, items in out.items()}


@pytest.mark.parametrize("case", [param(case) for case in CASES])
def test_a_stopped_and_resumed_run_is_the_unbroken_run(case, roots, request):
    root = roots[case.id]
    if case.ranks == "1":
        target = s3_target(case, request)
        unbroken = train(case, root / "unbroken", "unbroken", s3=target)
        if case.stop == "signal":
            stopped = signalled(request.getfixturevalue("signal_child"), case, root, target)
        else:
            stopped = train(case, root, "stopped", s3=target)
        resumed = train(case, root, "resumed", s3=target)
        check(case, unbroken, divergences(case, unbroken, stopped, resumed))
        assert stopped["code"] == (143 if case.stop == "signal" else 0)
        return
    runs = request.getfixturevalue("on_two_ranks")[case.id]
    if case.ranks == "2":
        found = [f"rank {rank}: {line}" for rank in range(2)
                 for line in divergences(case, runs["unbroken", rank], runs["stopped", rank], runs["resumed", rank])]
        check(case, runs["unbroken", 0], found)
        return
    # 2 -> 1: the global order of samples goes on, with a warning that random draws differ.
    resumed = train(case, root, "resumed", s3=runs["target"])
    stop = case.stop_step
    both = [d for rank in range(2) for d in runs["unbroken", rank]["draws"]]
    want = {key: items for key, items in merged(both).items() if key[0] > stop}
    assert merged(resumed["draws"]) == want
    assert resumed["step"] == runs["unbroken", 0]["step"]
    assert any("they are not restored" in line for line in resumed["warned"]), resumed["warned"]


def test_the_sample_covers_every_pair_of_values_of_the_in_process_axes():
    # DeepSpeed's formats are left out of the pairs: most pairs are refused by rule (deepspeed_refuses), and its
    # other combinations run in tests/distributed/test_deepspeed.py's launch.
    axes = [name for name in AXES if name != "ranks"]
    cases = [Case.from_id(i) for i in SAMPLE]
    values = {name: [v for v in AXES[name] if not str(v).startswith("zero")] for name in axes}
    missing = [
        (a, va, b, vb)
        for a, b in itertools.combinations(axes, 2) for va in values[a] for vb in values[b]
        if not any(getattr(c, a) == va and getattr(c, b) == vb for c in cases)
    ]
    assert missing == []
    assert [c.id for c in cases if deepspeed_refuses(c)] == []
    assert {c.format for c in cases} == set(AXES["format"])
    assert {c.ranks for c in cases} == set(AXES["ranks"])
    assert all(Case.from_id(i).id == i for i in SAMPLE)

