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


def test_the_readme_install_command_is_what_ci_runs_and_its_aws_stack_is_pinned():
    # Issue 32: unpinned, pip backtracked through s3fs/aiobotocore releases (aiobotocore's narrow botocore
    # range against moto's boto3) and ended on the CUDA torch. A fresh venv resolved the pins at once.
    import re
    import tomllib

    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'pip install torch==2.13.0 -e ".[dev]" && python -m pytest -q -n 2 --dist loadfile' in readme
    assert 'pip install --quiet torch==2.13.0 -e ".[dev]"' in ci
    assert "python -m pytest -q -n 2 --dist loadfile" in ci
    dev = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"]
    pinned = dict(re.fullmatch(r"([\w-]+)(?:\[[\w,]+\])?==([\w.]+)", r).groups() for r in dev if "==" in r)
    assert {"s3fs", "aiobotocore", "botocore", "boto3", "moto"} <= set(pinned)
    assert pinned["boto3"].rsplit(".", 1)[0] == pinned["botocore"].rsplit(".", 1)[0]  # boto3 x.y.z: botocore >=x.y.z,<x.(y+1)
    assert not any(r.startswith("moto[server]") for r in dev)  # every AWS service's packages, for one S3 server
