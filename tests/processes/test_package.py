"""Package-level promises: what importing costs, and the benchmark still runs."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_importing_trainloop_does_not_import_heavy_optional_packages():
    # Compared with what ``import torch`` loads by itself (torch.hub imports tqdm, for one).
    code = (
        "import sys, torch\n"
        "before = set(sys.modules)\n"
        "from trainloop import *  # every exported name (each is imported on first use)\n"
        "heavy = ('wandb', 'tensorboard', 'torch.utils.tensorboard', 'graphviz', 'rich', 'tqdm', 'PIL', 'yaml')\n"
        "print([m for m in heavy if m in sys.modules and m not in before])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_public_names_have_docstrings():
    import trainloop

    missing = [name for name in trainloop.__all__ if not getattr(trainloop, name).__doc__]
    assert missing == []


def test_overhead_benchmark_runs(tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "overhead.py"), "--steps", "5", "--rounds", "1"],
        capture_output=True, text=True, check=True, cwd=tmp_path,
    )
    assert out.stdout.startswith("raw loop:")
    assert "trainer (defaults: non-finite check on)" in out.stdout
    assert "ratio" in out.stdout
