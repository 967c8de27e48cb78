"""Multi-rank runs exit cleanly, by signal and normally: a few runs of benchmarks/exit_stress.py
(2 and 4 gloo ranks on 127.0.0.1, DDP, sharded checkpoints). The script runs 30 per
world size when asked (see docs/distributed.md for the figure measured); here a handful keep
the suite short, enough to catch a crash that is not rare."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ranks_end_with_0_or_143_never_a_crash():
    format = "sharded"  # its object collectives made exit crashes more likely
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "exit_stress.py"), "--runs", "2", "--world", "2", "4", "--format", format],
        capture_output=True, text=True, timeout=600, env=env, check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    assert f"0 of 4 runs crashed ({format} format)" in run.stdout
    assert run.stdout.count(" ok (") == 4
