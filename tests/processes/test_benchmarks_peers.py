"""benchmarks/peers.py runs end to end on the raw loop and trainloop and writes its report.

No peer library is needed (``--only raw,trainloop``) and no timing is asserted. Host syncs are
counted the way tests/support/sync_counter.py counts them; Hugging Face's Trainer is run for a few steps
when transformers (and Accelerate) are installed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "peers.py"
LOOPS = ROOT / "benchmarks" / "_peer_loops.py"


def load_syncs_module():
    spec = importlib.util.spec_from_file_location("peer_syncs", ROOT / "benchmarks" / "_syncs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_loops(*args: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, str(LOOPS), *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_peers(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT, timeout=120, check=False
    )


def test_writes_table_and_chart(tmp_path):
    output = tmp_path / "docs" / "peers.md"
    plot = tmp_path / "docs" / "img" / "peers.png"
    proc = run_peers(
        "--steps", "5", "--warmup", "2", "--rounds", "1", "--import-rounds", "1", "--models", "tiny",
        "--only", "raw,trainloop", "--sync-steps", "5", "--output", str(output), "--plot", str(plot),
    )
    assert proc.returncode == 0, proc.stderr
    text = output.read_text()
    assert "## tiny model (32-64-64-10, batch 32)" in text
    assert "## medium model" not in text
    rows = [line for line in text.splitlines() if line.startswith("| hand-written loop |")]
    # One row in the versions table, one in the step table, one in the import table.
    assert len(rows) == 3
    # Step table: ratio, then host syncs per step: none in the raw loop, trainloop's one
    # non-finite check with its defaults (the count tests/support/sync_counter.py makes).
    assert rows[1].endswith("| 1.00× | 0 |")
    trainloop_row = next(line for line in text.splitlines() if line.startswith("| trainloop | ") and "×" in line)
    assert trainloop_row.endswith("× | 1 |")
    assert "Host syncs per step: hand-written loop 0, trainloop 1." in text
    assert "trainloop's sync is its non-finite-gradient check" in text
    assert "from the end of step 2 to the end of the last one" in text
    # Peers left out by --only are not measured (their version is still listed).
    assert "| PyTorch Lightning | " in text
    assert not any(line.startswith("| PyTorch Lightning | ") and "×" in line for line in text.splitlines())
    assert "Machine: " in text
    assert " cores" in text
    assert "torch " in text
    # The Trainer's section is there even when it was not measured, and says so.
    assert "## Hugging Face's Trainer" in text
    assert "This run did not measure it." in text
    # The chart is a real PNG, referenced relative to the report.
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "](img/peers.png)" in text
    # The report also goes to stdout.
    assert "# trainloop and its peers" in proc.stdout


def test_without_raw_or_count_has_no_ratios_or_syncs(tmp_path):
    output = tmp_path / "peers.md"
    proc = run_peers(
        "--steps", "3", "--warmup", "0", "--rounds", "1", "--import-rounds", "0", "--models", "tiny",
        "--only", "trainloop", "--sync-steps", "0", "--output", str(output),
    )
    assert proc.returncode == 0, proc.stderr
    text = output.read_text()
    trainloop_rows = [line for line in text.splitlines() if line.startswith("| trainloop | ") and "|---" not in line]
    assert trainloop_rows[-1].endswith("| – | – |")  # no raw loop: no ratio; --sync-steps 0: no count
    assert "## Import time" not in text
    assert "Host syncs were not counted (`--sync-steps 0`)." in text
    assert "Host syncs per step" not in text


def test_counts_the_same_methods_as_the_step_test():
    from sync_counter import SyncCounter

    assert load_syncs_module().SYNC_METHODS == SyncCounter.METHODS


def test_host_syncs_counts_every_method_and_restores_them():
    syncs = load_syncs_module()
    before = {name: getattr(torch.Tensor, name) for name in syncs.SYNC_METHODS}
    t = torch.tensor([1.5])
    with syncs.HostSyncs() as counter:
        t.item(), t.tolist(), t.numpy(), bool(t), float(t), int(t), [0, 1][torch.tensor(1)]
        t + t  # arithmetic stays on the device: not a sync
    assert counter.count == 7
    assert {name: getattr(torch.Tensor, name) for name in syncs.SYNC_METHODS} == before
    t.item()
    assert counter.count == 7  # nothing counts once the block is left


def test_syncs_per_step_counts_the_steady_state_only():
    syncs = load_syncs_module()
    t = torch.tensor(2.0)

    def run(after_step, steps=6):
        t.item()  # start-up: not counted
        for step in range(steps):
            for _ in range(3 if step == 0 else 2):  # lazy first-step work: not counted
                t.item()
            after_step()
        t.item()  # shut-down: not counted

    assert syncs.syncs_per_step(run, steps=6, skip=2) == {"syncs_per_step": 2.0, "steps": 4}
    with pytest.raises(RuntimeError, match="ran 6 times in 7 steps"):
        syncs.syncs_per_step(run, steps=7, skip=2)
    with pytest.raises(ValueError, match="skip=6, steps=6"):
        syncs.syncs_per_step(run, steps=6, skip=6)


@pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None or importlib.util.find_spec("accelerate") is None,
    reason="transformers and accelerate (the bench extra) not installed",
)
def test_hugging_face_trainer_runs_the_same_steps():
    # The child raises if the Trainer ran another number of steps or called back another number
    # of times; its two syncs are torch.isnan(loss) or torch.isinf(loss) (logging_nan_inf_filter)
    # in the pinned transformers, which the report's prose names only when this count holds.
    assert run_loops("syncs", "transformers", "tiny", "4") == {"syncs_per_step": 2.0, "steps": 2}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--models", "huge"], "--models: expected a comma-separated subset of tiny,medium"),
        (["--only", "raw,keras"], "--only: expected a comma-separated subset of"),
        (["--only", ""], "--only: expected"),
        (["--steps", "0"], "--steps must be positive"),
        (["--rounds", "-1"], "--rounds must be positive"),
        (["--steps", "many"], "invalid int value"),
        (["--sync-steps", "2"], "--sync-steps must be 0 (skip) or more than the 2 steps"),
        (["--sync-steps", "-1"], "--sync-steps must be positive"),
    ],
)
def test_bad_arguments_are_rejected(tmp_path, args, message):
    output = tmp_path / "peers.md"
    proc = run_peers(*args, "--output", str(output))
    assert proc.returncode == 2
    assert message in proc.stderr
    assert not output.exists()


def test_summary_calls_close_figures_a_tie(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from _peer_report import summary

    steps = {
        "tiny": {
            "raw": {"ratio": 1.0, "syncs": 0.0},
            "trainloop": {"ratio": 1.20, "syncs": 1.0},
            "ignite": {"ratio": 1.10, "syncs": 1.0},
            "transformers": {"ratio": 3.0, "syncs": 2.0},
        }
    }
    imports = {"trainloop": {"beyond_torch": 0.47}, "accelerate": {"beyond_torch": 0.48}, "ignite": {"beyond_torch": 1.8}}
    text = " ".join(summary(steps, imports))
    assert 'Goal "closest to the hand-written loop on the tiny model": not met (PyTorch Ignite is closer).' in text
    assert 'Goal "fastest import": met, but Accelerate is within 0.05 s of trainloop' in text
    # Each count is explained only where this run counted what the explanation says.
    assert "Hugging Face Trainer's 2 are `torch.isnan(loss) or torch.isinf(loss)`" in text
    steps["tiny"]["transformers"]["syncs"] = 3.0
    assert "Hugging Face Trainer's" not in " ".join(summary(steps, imports))
