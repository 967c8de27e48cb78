"""benchmarks/peers.py runs end to end on the raw loop and trainloop and writes its report.

No peer library is needed (``--only raw,trainloop``) and no timing is asserted.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "peers.py"


def run_peers(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT, timeout=120, check=False
    )


def test_writes_table_and_chart(tmp_path):
    output = tmp_path / "docs" / "peers.md"
    plot = tmp_path / "docs" / "img" / "peers.png"
    proc = run_peers(
        "--steps", "5", "--warmup", "2", "--rounds", "1", "--import-rounds", "1", "--models", "tiny",
        "--only", "raw,trainloop", "--output", str(output), "--plot", str(plot),
    )
    assert proc.returncode == 0, proc.stderr
    text = output.read_text()
    assert "## tiny model (32-64-64-10, batch 32)" in text
    assert "## medium model" not in text
    rows = [line for line in text.splitlines() if line.startswith("| hand-written loop |")]
    # One row in the versions table, one in the step table, one in the import table.
    assert len(rows) == 3
    assert "| hand-written loop | " in text and "| 1.00× |" in text
    assert any(line.startswith("| trainloop | ") and line.endswith("× |") for line in text.splitlines())
    # Peers left out by --only are not measured (their version is still listed).
    assert "| PyTorch Lightning | " in text
    assert not any(line.startswith("| PyTorch Lightning | ") and "×" in line for line in text.splitlines())
    assert "Machine: " in text and " cores" in text and "torch " in text
    # The chart is a real PNG, referenced relative to the report.
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "](img/peers.png)" in text
    # The report also goes to stdout.
    assert "# trainloop and its peers" in proc.stdout


def test_without_raw_has_no_ratios(tmp_path):
    output = tmp_path / "peers.md"
    proc = run_peers(
        "--steps", "3", "--warmup", "0", "--rounds", "1", "--import-rounds", "0", "--models", "tiny",
        "--only", "trainloop", "--output", str(output),
    )
    assert proc.returncode == 0, proc.stderr
    text = output.read_text()
    trainloop_rows = [line for line in text.splitlines() if line.startswith("| trainloop | ") and "|---" not in line]
    assert trainloop_rows[-1].endswith("| – |")
    assert "## Import time" not in text


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--models", "huge"], "--models: expected a comma-separated subset of tiny,medium"),
        (["--only", "raw,keras"], "--only: expected a comma-separated subset of"),
        (["--only", ""], "--only: expected"),
        (["--steps", "0"], "--steps must be positive"),
        (["--rounds", "-1"], "--rounds must be positive"),
        (["--steps", "many"], "invalid int value"),
    ],
)
def test_bad_arguments_are_rejected(tmp_path, args, message):
    output = tmp_path / "peers.md"
    proc = run_peers(*args, "--output", str(output))
    assert proc.returncode == 2
    assert message in proc.stderr
    assert not output.exists()
