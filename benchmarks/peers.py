"""trainloop against the libraries users would pick instead: per-step time and import time.

Contenders: a hand-written loop (``raw``), trainloop (``BaseTrainer``, default settings),
PyTorch Lightning (``Trainer`` with logger, checkpointing, progress bar and model summary off),
Hugging Face Accelerate (``Accelerator().prepare`` and a plain loop with ``accelerator.backward``),
PyTorch Ignite (``create_supervised_trainer``) and Hugging Face's ``transformers.Trainer`` (logging,
saving, reporting and progress bar off). Each trains the same MLP on the CPU with one thread
(tiny: 32-64-64-10, batch 32; medium: 256-1024-1024-10, batch 128); the loops are in
``benchmarks/_peer_loops.py``.

Every measurement is a fresh child process that warms up with a complete run, then times only
its training loop with ``time.process_time``. The contenders alternate within each round (the
order rotates round to round) and each is divided by the raw loop of the same round; the table
reports medians over rounds. This machine is shared and noisy: the ratios, taken side by side,
are what is comparable. Host syncs per step (calls of the Tensor methods that stall the host
until a GPU has caught up, counted as trainloop's own test counts them) come from a separate
short pass per contender and model (``--sync-steps``), so the counting does not touch the
timings. Import time is the wall time of ``import torch`` + the library's import in a fresh
process, median of ``--import-rounds``. Peers that are not installed are reported as such and
skipped.

Run: ``python benchmarks/peers.py [--steps 300] [--rounds 5] [--models tiny,medium]
[--sync-steps 20] [--output docs/peers.md] [--plot docs/img/peers.png] [--figures FILE.json]``

docs/peers.md was made with ``--steps 1000 --medium-steps 40 --rounds 9 --output docs/peers.md
--plot docs/img/peers.png``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from _peer_loops import SKIP_STEPS  # the script's own directory is on sys.path
from _peer_report import CONTENDERS, LABELS, render_markdown, render_plot

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
LOOPS = HERE / "_peer_loops.py"

PACKAGES = {
    "raw": (("torch",), ("torch",)),
    "trainloop": (("trainloop",), ("trainloop",)),
    "lightning": (("lightning", "pytorch_lightning"), ("lightning", "pytorch-lightning")),
    "accelerate": (("accelerate",), ("accelerate",)),
    "ignite": (("ignite",), ("pytorch-ignite",)),
    "transformers": (("transformers",), ("transformers",)),
}
# Modules a contender needs besides its own (transformers' Trainer runs on Accelerate).
NEEDS = {"transformers": ("accelerate",)}
MODEL_NAMES = ("tiny", "medium")


def installed(contender: str) -> bool:
    """Whether the contender's library (and what it needs to train) can be imported here."""
    found = importlib.util.find_spec
    return any(found(m) is not None for m in PACKAGES[contender][0]) and all(
        found(m) is not None for m in NEEDS.get(contender, ())
    )


def version(contender: str) -> str:
    """The installed version of the contender's distribution, or ``"not installed"``."""
    for dist in PACKAGES[contender][1]:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return "not installed"


def _child(*args: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    # One thread everywhere, including OpenMP/MKL pools created before set_num_threads runs.
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(
        [sys.executable, str(LOOPS), *args], capture_output=True, text=True, env=env, cwd=ROOT, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"child {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure_steps(contenders: list[str], model: str, steps: int, warmup: int, rounds: int) -> dict[str, dict]:
    """Per-step CPU time of each contender, alternated round by round, in child processes.

    Returns, per contender, ``{"us_per_step": median µs, "ratio": median of per-round ratios to
    the raw loop of the same round}`` (ratio ``None`` when ``raw`` is not among the contenders).
    """
    times: dict[str, list[float]] = {name: [] for name in contenders}
    ratios: dict[str, list[float]] = {name: [] for name in contenders}
    for round_ in range(rounds):
        # Rotate the order so no contender always runs first or last in a round.
        shift = round_ % len(contenders)
        order = contenders[shift:] + contenders[:shift]
        this_round = {}
        for name in order:
            result = _child("train", name, model, str(steps), str(warmup))
            this_round[name] = result["seconds"] / result["steps"]
        print(
            f"  {model} round {round_ + 1}/{rounds}: "
            + ", ".join(f"{n} {this_round[n] * 1e6:.0f} µs" for n in contenders),
            file=sys.stderr,
            flush=True,
        )
        for name in contenders:
            times[name].append(this_round[name])
            if "raw" in this_round:
                ratios[name].append(this_round[name] / this_round["raw"])
    return {
        name: {
            "us_per_step": statistics.median(times[name]) * 1e6,
            "ratio": statistics.median(ratios[name]) if ratios[name] else None,
        }
        for name in contenders
    }


def measure_syncs(contenders: list[str], model: str, steps: int) -> dict[str, float]:
    """Host syncs per optimizer update of each contender (one counting child each, not timed)."""
    return {name: _child("syncs", name, model, str(steps))["syncs_per_step"] for name in contenders}


def measure_imports(contenders: list[str], rounds: int) -> dict[str, dict]:
    """Median wall seconds of ``import torch`` + the library (``total``) and of the library alone."""
    totals: dict[str, list[float]] = {name: [] for name in contenders}
    beyond: dict[str, list[float]] = {name: [] for name in contenders}
    for round_ in range(rounds):
        shift = round_ % len(contenders)
        for name in contenders[shift:] + contenders[:shift]:
            result = _child("import", name)
            totals[name].append(result["total"])
            beyond[name].append(result["beyond_torch"])
    return {
        name: {"total": statistics.median(totals[name]), "beyond_torch": statistics.median(beyond[name])}
        for name in contenders
    }


def machine() -> dict[str, str]:
    """CPU model, core count, Python and torch versions of this machine."""
    cpu = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": str(os.cpu_count()),
        "python": platform.python_version(),
        "torch": version("raw"),
        "os": f"{platform.system()} {platform.release()}",
    }


def _csv(value: str, allowed: tuple[str, ...], what: str) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in allowed]
    if bad or not items:
        raise argparse.ArgumentTypeError(
            f"{what}: expected a comma-separated subset of {','.join(allowed)}, got {value!r}"
        )
    return items


def main(argv: list[str] | None = None) -> None:
    """Measure, print the markdown report, and write it (and the chart) if asked."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="timed steps per run")
    parser.add_argument(
        "--medium-steps", type=int, default=None, help="timed steps on the medium model (default: --steps)"
    )
    parser.add_argument("--warmup", type=int, default=50, help="steps of the warm-up run in each child")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--import-rounds", type=int, default=5, help="fresh-process imports per contender (0: skip)")
    parser.add_argument("--sync-steps", type=int, default=20, help="steps of the host-sync counting pass (0: skip)")
    parser.add_argument("--models", type=lambda v: _csv(v, MODEL_NAMES, "--models"), default=list(MODEL_NAMES))
    parser.add_argument("--only", type=lambda v: _csv(v, CONTENDERS, "--only"), default=list(CONTENDERS))
    parser.add_argument("--output", type=Path, default=None, help="write the markdown report here")
    parser.add_argument("--plot", type=Path, default=None, help="write the bar chart (PNG) here")
    parser.add_argument("--figures", type=Path, default=None, help="write the measured figures (JSON) here")
    args = parser.parse_args(argv)
    for name in ("steps", "rounds", "warmup", "import_rounds", "medium_steps", "sync_steps"):
        value = getattr(args, name)
        if value is not None and (value < 0 or (value == 0 and name in ("steps", "rounds", "medium_steps"))):
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if 0 < args.sync_steps <= SKIP_STEPS:
        parser.error(f"--sync-steps must be 0 (skip) or more than the {SKIP_STEPS} steps the count leaves out")

    contenders = [n for n in CONTENDERS if n in args.only]
    skipped = [n for n in contenders if not installed(n)]
    for name in skipped:
        print(f"{LABELS[name]}: not installed, skipped", file=sys.stderr)
    contenders = [n for n in contenders if n not in skipped]

    steps: dict[str, dict[str, dict]] = {}
    for model in args.models:
        n = args.medium_steps if model == "medium" and args.medium_steps else args.steps
        steps[model] = measure_steps(contenders, model, n, args.warmup, args.rounds)
        if args.sync_steps:
            for name, count in measure_syncs(contenders, model, args.sync_steps).items():
                steps[model][name]["syncs"] = count
    imports = measure_imports(contenders, args.import_rounds) if args.import_rounds else {}
    if args.figures:
        args.figures.parent.mkdir(parents=True, exist_ok=True)
        args.figures.write_text(json.dumps({"steps": steps, "imports": imports, "skipped": skipped}, indent=1))

    plot_ref = None
    if args.plot:
        render_plot(steps, imports, args.plot)
        base = args.output.resolve().parent if args.output else Path.cwd()
        plot_ref = os.path.relpath(args.plot.resolve(), base)
    report = render_markdown(steps, imports, skipped, args, plot_ref, {n: version(n) for n in CONTENDERS}, machine())
    print(report)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(report)


if __name__ == "__main__":
    main()
