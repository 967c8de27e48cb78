"""The torchrun recipe of docs/distributed.md, for real: two gloo workers on 127.0.0.1 running
examples/ddp/train.py under ``torchrun --max-restarts=1`` with
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``.

- SIGTERM to torchrun (what a scheduler sends): torchrun forwards it; the workers agree on a
  step, save it and exit; torchrun itself exits 1 (its SignalException).
- A worker killed (SIGKILL, a lost process): torchrun restarts both, they resume from the
  latest checkpoint, and the run ends with exit 0.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from child_process import HIDDEN_GPUS

from trainloop.checkpoint import checkpoint_steps, read_metadata

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "ddp" / "train.py"
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")

pytestmark = pytest.mark.skipif(pytest.importorskip("sklearn") is None, reason="the example needs scikit-learn")


def start(workspace: Path, max_steps: int) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", **HIDDEN_GPUS)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max-restarts=1",
        str(SCRIPT), "--workspace", str(workspace), "--max-steps", str(max_steps),
    ]  # fmt: skip
    return subprocess.Popen(command, cwd=workspace.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_a_checkpoint(proc: subprocess.Popen, root: Path, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not (root / "latest").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"no checkpoint under {root}: {proc.communicate()[1][-3000:]}")
        time.sleep(0.2)


def finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return proc.returncode, out, err


def test_sigterm_to_torchrun_saves_on_every_worker_and_torchrun_exits_1(tmp_path):
    workspace = tmp_path / "ws"
    proc = start(workspace, max_steps=1_000_000)
    root = workspace / "checkpoints"
    wait_for_a_checkpoint(proc, root)
    proc.send_signal(signal.SIGTERM)
    code, out, err = finish(proc)
    # torchrun's own SignalException, however the workers ended. Under load its agent sometimes
    # aborts while the interpreter shuts down after raising it (torch's C++ store thread:
    # "terminate called without an active exception"): torchrun's exit, not the workers'.
    aborted_on_its_way_out = code == -signal.SIGABRT and "terminate called without an active exception" in err
    assert code == 1 or aborted_on_its_way_out, err[-3000:]
    assert "SignalException" in err
    assert "got signal: 15" in err
    stop = checkpoint_steps(root)[-1]
    assert stop > 100, checkpoint_steps(root)
    assert stop % 100, checkpoint_steps(root)  # not a scheduled save: the exit save
    assert "Caught SIGTERM during step" in err, err[-3000:]
    assert f"Saved checkpoint {root / str(stop)}" in err
    assert read_metadata(root / str(stop))["step"] == stop


def test_a_killed_worker_is_restarted_and_resumes_from_the_latest_checkpoint(tmp_path):
    workspace = tmp_path / "ws"
    proc = start(workspace, max_steps=300)
    root = workspace / "checkpoints"
    wait_for_a_checkpoint(proc, root)
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    os.kill(int(children[-1]), signal.SIGKILL)  # one worker lost
    code, out, err = finish(proc)
    assert code == 0, err[-3000:]
    assert "final accuracy" in out
    assert "after 300 steps on 2 ranks" in out
    loaded = [line for line in err.splitlines() if "Resumed from" in line]  # one line says it
    assert len(loaded) == 1, loaded
    assert loaded[0].endswith(("checkpoints/100 at step 100", "checkpoints/200 at step 200")), loaded
    assert checkpoint_steps(root) == [300]


def test_a_warning_is_said_once_not_once_per_rank(tmp_path):
    workspace = tmp_path / "ws"
    for max_steps in (20, 30):  # the second resumes the first's last checkpoint with other settings
        code, out, err = finish(start(workspace, max_steps=max_steps))
        assert code == 0, err[-3000:]
    assert err.count("ChangedSettingsWarning") == 1, err[-3000:]
    assert "resuming with settings that differ from the checkpoint's: max_steps" in err
