"""The workspace as users meet it: paths that cannot be used, two runs in one workspace, the
files trainloop writes there (strict JSON, appends after a killed writer).

Bad input runs the real CLI (a subprocess for each kind of failure a user sees, in-process
``main()`` for the variants); two runs are two real processes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from cli_process import Cli, assert_one_clean_error, call, cli_env
from tiny_trainer import TinyTrainer

from trainloop import CheckpointingHook, ValidationHook
from trainloop.core.result import read_runs
from trainloop.core.workspace import LOCK_FILE

TRAINER = "cli_trainers:CliTrainer"

pytestmark = pytest.mark.usefixtures("isolated_cli")  # see tests/conftest.py


def _strict(text: str):
    """``json.loads`` that refuses NaN and Infinity, as strict JSON readers do."""

    def refuse(constant: str):
        raise ValueError(f"not strict JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def _listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


# -- empty paths ---------------------------------------------------------------------------------


def test_an_empty_workspace_from_set_is_an_error_naming_it(tmp_path):
    (tmp_path / "run.json").write_text('{"max_steps": 2}')
    result = Cli("run", "run.json", "--trainer", TRAINER, "--set", "workspace=", cwd=tmp_path).result()
    assert result.returncode == 2, result.stderr
    assert_one_clean_error(result.stderr, "--set workspace=: workspace:", "empty path")
    assert result.stderr.count("\n") == 1
    assert _listing(tmp_path) == ["run.json"]


@pytest.mark.parametrize(
    ("hook", "field"),
    [
        ({"type": "checkpointing", "interval": 1, "path": ""}, "hooks[0].path"),
        ({"type": "checkpointing", "interval": 1, "path": "  "}, "hooks[0].path"),
        ({"type": "tensorboard", "log_dir": ""}, "hooks[0].log_dir"),
    ],
)
def test_an_empty_hook_path_is_an_error_naming_it(tmp_path, capsys, hook, field):
    (tmp_path / "run.json").write_text(json.dumps({"max_steps": 2, "workspace": "ws", "hooks": [hook]}))
    for command in ("run", "validate"):
        code, out, err = call(capsys, command, "run.json", "--trainer", TRAINER)
        assert code == 2
        assert out == ""
        assert_one_clean_error(err, f"run.json: {field}: ", "empty path")
    assert _listing(tmp_path) == ["run.json"]


# -- a workspace that cannot be used -------------------------------------------------------------


def _read_only(directory: Path) -> None:
    """Make ``directory`` unwritable, even for root (chattr +i), or skip."""
    directory.chmod(stat.S_IRUSR | stat.S_IXUSR)
    if os.access(directory, os.W_OK):
        if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(directory)], capture_output=True).returncode:
            directory.chmod(0o755)
            pytest.skip("cannot make a directory read-only for this user")


def _writable(directory: Path) -> None:
    if shutil.which("chattr"):
        subprocess.run(["chattr", "-i", str(directory)], capture_output=True)
    directory.chmod(0o755)


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("a file", "workspace: ws: is a file, not a directory"),
        ("under a file", "workspace: f/ws: f is a file, not a directory"),
        ("a NUL byte", "workspace: 'w\\x00s': a path cannot hold a NUL byte"),
        ("read-only", "workspace: ro/ws: the directory (ro) is not writable"),
        ("checkpoints a file", "hooks[0].path: ws/checkpoints: is a file, not a directory"),
    ],
)
def test_an_unusable_workspace_is_refused_before_any_step(tmp_path, capsys, case, message):
    settings = {"max_steps": 2, "workspace": "ws", "hooks": [{"type": "checkpointing", "interval": 1}]}
    if case == "a file":
        (tmp_path / "ws").write_text("")
    elif case == "under a file":
        (tmp_path / "f").write_text("")
        settings["workspace"] = "f/ws"
    elif case == "a NUL byte":
        settings["workspace"] = "w\0s"
    elif case == "read-only":
        (tmp_path / "ro").mkdir()
        settings["workspace"] = "ro/ws"
    else:
        (tmp_path / "ws").mkdir()
        (tmp_path / "ws" / "checkpoints").write_text("")
    (tmp_path / "run.json").write_text(json.dumps(settings))
    before = _listing(tmp_path)
    if case == "read-only":
        _read_only(tmp_path / "ro")
    try:
        for command in ("validate", "run"):
            code, out, err = call(capsys, command, "run.json", "--trainer", TRAINER)
            assert code == 2, err
            assert out == "", err
            assert_one_clean_error(err, f"trainloop {command}: error: run.json: {message}\n")
            assert err.count("\n") == 1
    finally:
        if case == "read-only":
            _writable(tmp_path / "ro")
    assert _listing(tmp_path) == before


def test_an_unusable_workspace_is_one_line_from_a_real_run(tmp_path):
    (tmp_path / "ws").write_text("")
    (tmp_path / "run.json").write_text('{"max_steps": 2, "workspace": "ws"}')
    result = Cli("run", "run.json", "--trainer", TRAINER, cwd=tmp_path).result()
    assert result.returncode == 2
    assert result.stderr == "trainloop run: error: run.json: workspace: ws: is a file, not a directory\n"


def test_a_failing_runs_record_never_masks_the_error_that_ended_the_run(tmp_path, caplog):
    class Broken(TinyTrainer):
        def forward(self, batch):
            raise RuntimeError("the real error")

    (tmp_path / "runs.jsonl").mkdir()  # the record of the run cannot be appended
    with pytest.raises(RuntimeError, match="the real error"):
        Broken(max_steps=2, workspace=tmp_path).train()
    assert "Could not record the run" in caplog.text


# -- two runs in one workspace -------------------------------------------------------------------


def _start(tmp_path: Path, settings: dict) -> subprocess.Popen[str]:
    (tmp_path / "run.json").write_text(json.dumps(settings))
    return subprocess.Popen(
        [sys.executable, "-m", "trainloop", "run", "run.json", "--trainer", TRAINER],
        cwd=tmp_path, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def _wait_for_step(process: subprocess.Popen[str], step: int) -> None:
    assert process.stdout is not None
    for line in process.stdout:
        if line == f"step {step}\n":
            return
    pytest.fail(f"the run ended before step {step}: {process.stderr.read() if process.stderr else ''}")


def test_a_second_run_in_a_held_workspace_is_refused_naming_the_holder(tmp_path):
    settings = {
        "max_steps": 100_000, "workspace": "ws", "step_sleep": 0.02, "report": True,
        "hooks": [{"type": "checkpointing", "interval": 1_000_000, "exit_signals": ["SIGTERM"]}],
    }
    first = _start(tmp_path, settings)
    try:
        _wait_for_step(first, 2)
        before = {p: p.read_bytes() for p in (tmp_path / "ws").rglob("*") if p.is_file() and p.name != "metrics.jsonl"}
        second = Cli("run", "run.json", "--trainer", TRAINER, cwd=tmp_path).result()
        assert second.returncode == 2
        assert second.stderr == (
            f"trainloop run: error: ws: in use by the run of PID {first.pid} on host {socket.gethostname()} "
            f"(since {second.stderr.split('(since ')[1].split(')')[0]}); wait for it to end or give another workspace\n"
        )
        after = {p: p.read_bytes() for p in (tmp_path / "ws").rglob("*") if p.is_file() and p.name != "metrics.jsonl"}
        assert after == before  # the second run wrote nothing
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert first.returncode == 143
    assert [run["exit_code"] for run in read_runs(tmp_path / "ws")] == [143]  # one run recorded
    # Released: the next run goes ahead.
    settings.update(max_steps=3, step_sleep=0.0, report=False)
    (tmp_path / "run.json").write_text(json.dumps(settings))
    again = Cli("run", "run.json", "--trainer", TRAINER, cwd=tmp_path).result()
    assert again.returncode == 0, again.stderr
    assert "Taking over" not in again.stderr


def test_the_lock_of_a_killed_run_is_taken_over_with_a_message(tmp_path):
    settings = {"max_steps": 100_000, "workspace": "ws", "step_sleep": 0.02, "report": True}
    first = _start(tmp_path, settings)
    try:
        _wait_for_step(first, 1)
        first.kill()  # SIGKILL: no cleanup, the lock file still names it
        first.communicate(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert str(first.pid) in (tmp_path / "ws" / LOCK_FILE).read_text()
    settings.update(max_steps=2, step_sleep=0.0, report=False)
    (tmp_path / "run.json").write_text(json.dumps(settings))
    second = Cli("run", "run.json", "--trainer", TRAINER, cwd=tmp_path).result()
    assert second.returncode == 0, second.stderr
    assert f"Taking over ws/{LOCK_FILE} from the run of PID {first.pid} on host {socket.gethostname()}" in second.stderr
    assert (tmp_path / "ws" / LOCK_FILE).read_text() == ""  # released at the end


@pytest.mark.parametrize("garbage", [b"\xff\xfe\x80not utf-8", b"\x00\x00\x00", b"not json at all\n"])
def test_a_lock_file_holding_garbage_is_taken_over(tmp_path, garbage):
    # Issue 29, defect 7: bytes that are not UTF-8 failed every run of the workspace with UnicodeDecodeError.
    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / LOCK_FILE).write_bytes(garbage)
    (tmp_path / "run.json").write_text(json.dumps({"max_steps": 2, "workspace": "ws"}))
    result = Cli("run", "run.json", "--trainer", TRAINER, cwd=tmp_path).result()
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"Taking over ws/{LOCK_FILE} from another run, which is gone" in result.stderr
    assert "Traceback" not in result.stderr
    assert (tmp_path / "ws" / LOCK_FILE).read_bytes() == b""


def test_two_trainers_in_one_process_and_one_workspace(tmp_path):
    # The lock is the OS's, per open file: a trainer training inside another's run is refused too.
    from trainloop.core.workspace import WorkspaceBusyError

    class Inner(TinyTrainer):
        def build_model(self):
            with pytest.raises(WorkspaceBusyError, match=f"in use by the run of PID {os.getpid()}"):
                TinyTrainer(max_steps=1, workspace=tmp_path).train()
            return super().build_model()

    Inner(max_steps=1, workspace=tmp_path).train()
    TinyTrainer(max_steps=2, workspace=tmp_path).train()  # released after each run


# -- the files written there ---------------------------------------------------------------------


def test_a_cut_off_last_line_of_runs_jsonl_does_not_swallow_the_next_record(tmp_path):
    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / "runs.jsonl").write_text('{"time": 1.0, "step": 3, "exit_code": 0}\n{"time": 2.0, "st')
    (tmp_path / "run.json").write_text('{"max_steps": 2, "workspace": "ws", "trace": true}')
    (tmp_path / "ws" / "trace.jsonl").write_text('{"time": 1.0, "step": 0, "sou')
    result = Cli("run", "run.json", "--trainer", TRAINER, cwd=tmp_path).result()
    assert result.returncode == 0, result.stderr
    assert [(run["step"], run["exit_code"]) for run in read_runs(tmp_path / "ws")] == [(3, 0), (2, 0)]
    for line in (tmp_path / "ws" / "trace.jsonl").read_text().splitlines():
        _strict(line)  # the cut-off line is gone, not joined to the next


def test_every_json_file_of_a_run_is_strict_json(tmp_path):
    scores = {2: float("inf"), 4: 0.5, 6: float("nan")}
    validation = ValidationHook(lambda t: {"loss": scores.get(t.step, 1.0)}, interval=2)
    hook = CheckpointingHook(interval=2, keep_best=2, monitor="val/loss")
    TinyTrainer(max_steps=6, hooks=[validation, hook], workspace=tmp_path, trace=True).train()
    files = [p for p in tmp_path.rglob("*") if p.suffix in (".json", ".jsonl")]
    assert {p.name for p in files} >= {"best.json", "metrics.jsonl", "runs.jsonl", "settings.json", "trace.jsonl", "metadata.json"}
    for path in files:
        text = path.read_text()
        for part in text.splitlines() if path.suffix == ".jsonl" else [text]:
            _strict(part)
    best = _strict((tmp_path / "checkpoints" / "best.json").read_text())
    assert best["scores"]["4"] == 0.5
    assert best["scores"].get("2", None) is None


def test_a_second_run_on_a_live_runs_checkpoint_path_is_refused_and_loses_nothing(tmp_path):
    from cli_process import two_runs_on_one_checkpoint_location

    two_runs_on_one_checkpoint_location(tmp_path, str(tmp_path / "shared"))
