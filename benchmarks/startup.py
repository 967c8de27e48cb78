"""How long the front door takes: ``trainloop --help``, each subcommand's ``--help``, and what
``import trainloop`` adds to ``import torch``.

Each case is a fresh process (``python -c ...`` or ``python -m trainloop ...``), timed wall-clock
from start to exit and by its CPU time (user + system, from ``wait4``; on a machine shared with
other work the wall time mostly measures the wait for a core, the CPU time much less so). The
cases are interleaved round by round (the order rotated) and the median over rounds is reported.
``python -c pass`` is the interpreter's own floor. ``import trainloop`` imports its names on first use, so what a
user pays is the line that takes the contract (``from trainloop import BaseTrainer, TrainerSettings``).

Run: ``python benchmarks/startup.py [--rounds 7] [--source DIR]``; ``--source`` is the checkout
whose ``trainloop`` is timed (default: this one), ``--markdown`` prints the table
docs/benchmarks.md holds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMMANDS = ("run", "validate", "schema", "graph", "inspect", "report")
CONTRACT = "from trainloop import BaseTrainer, TrainerSettings, CheckpointingHook"

CASES: dict[str, list[str]] = {
    "python -c pass": ["-c", "pass"],
    "trainloop --help": ["-m", "trainloop", "--help"],
    **{f"trainloop {command} --help": ["-m", "trainloop", command, "--help"] for command in COMMANDS},
    "import torch": ["-c", "import torch"],
    "import torch; import pydantic": ["-c", "import torch; import pydantic"],
    "import torch; import trainloop": ["-c", "import torch; import trainloop"],
    f"import torch; {CONTRACT}": ["-c", f"import torch; {CONTRACT}"],
}


def timed(args: list[str], source: Path) -> tuple[float, float]:
    """Wall and CPU seconds of ``python ARGS`` (which must succeed), ``source`` first on the path."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(source), os.environ.get("PYTHONPATH")]))}
    start = time.perf_counter()
    # From the filesystem root: the working directory comes first on the path of `-c` and `-m`.
    process = subprocess.Popen([sys.executable, *args], stdout=subprocess.DEVNULL, env=env, cwd="/")
    _, status, usage = os.wait4(process.pid, 0)
    elapsed = time.perf_counter() - start
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        raise SystemExit(f"{args} exited with {process.returncode}")
    return elapsed, usage.ru_utime + usage.ru_stime


def measure(rounds: int, source: Path) -> dict[str, tuple[float, float]]:
    """The median wall and CPU time of each case over ``rounds`` interleaved rounds."""
    names = list(CASES)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            times[name].append(timed(CASES[name], source))
    return {
        name: (statistics.median(w for w, _ in values), statistics.median(c for _, c in values))
        for name, values in times.items()
    }


def main() -> None:
    """Measure and print the medians, and what trainloop adds to ``import torch``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    parser.add_argument("--source", type=Path, default=REPO, help="the checkout whose trainloop is timed")
    args = parser.parse_args()
    medians = measure(args.rounds, args.source.resolve())
    wall0, cpu0 = medians["import torch"]
    if args.markdown:
        print("| process | wall (median) | CPU (median) | CPU added to `import torch` |\n|---|---|---|---|")
    for name, (wall, cpu) in medians.items():
        added = f"{cpu - cpu0:+.3f} s" if name.startswith("import torch;") else ""
        if args.markdown:
            print(f"| `{name}` | {wall:.3f} s | {cpu:.3f} s | {added} |")
        else:
            print(f"{name:<80} wall {wall:6.3f} s  cpu {cpu:6.3f} s  {added}")
    print(f"\n{args.rounds} rounds of {args.source.resolve()}; load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
