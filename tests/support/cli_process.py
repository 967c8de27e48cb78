"""The ``trainloop`` command line in a subprocess (or in-process through ``main()``), shared by
the CLI tests."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from trainloop.cli import main

SUPPORT = Path(__file__).resolve().parent  # tests/support: the test helpers
REPO = SUPPORT.parents[1]


def cli_env(**extra: str) -> dict[str, str]:
    """The environment of a CLI subprocess: tests/ importable, no stray TRAINLOOP_* variables."""
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("TRAINLOOP_")}
    env["PYTHONPATH"] = os.pathsep.join([str(SUPPORT), str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(extra)
    return env


def console_script() -> str:
    """The installed ``trainloop`` script (``pip install -e .`` puts it beside the interpreter)."""
    beside = Path(sys.executable).with_name("trainloop")
    found = str(beside) if beside.is_file() else shutil.which("trainloop")
    if found is None:
        pytest.skip("the trainloop console script is not installed (run `pip install -e .`)")
    return found


class Cli:
    """``python -m trainloop ARGS`` (or the console script) started now, awaited by :meth:`result`.

    Independent commands are started together so that their torch imports overlap.
    """

    def __init__(self, *args: object, cwd: Path, env: dict[str, str] | None = None, script: bool = False) -> None:
        command = [console_script()] if script else [sys.executable, "-m", "trainloop"]
        # Files, not pipes: a process whose output nobody reads yet must not block on a full pipe.
        # Closed in result(), not by a with-block: they outlive __init__.
        self._out, self._err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        self._process = subprocess.Popen(
            [*command, *map(str, args)], cwd=cwd, env=env or cli_env(), stdout=self._out, stderr=self._err, text=True
        )
        self._result: subprocess.CompletedProcess[str] | None = None

    def result(self) -> subprocess.CompletedProcess[str]:
        """Wait for the command; its exit code, stdout and stderr."""
        if self._result is None:
            try:
                code = self._process.wait(timeout=180)
            finally:
                if self._process.poll() is None:
                    self._process.kill()
                    self._process.wait()
            self._out.seek(0)
            self._err.seek(0)
            self._result = subprocess.CompletedProcess(self._process.args, code, self._out.read(), self._err.read())
            self._out.close()
            self._err.close()
        return self._result


def call(capsys: pytest.CaptureFixture[str], *args: object) -> tuple[int, str, str]:
    """Run ``main()`` in this process; return its exit code, stdout and stderr."""
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_clean_error(err: str, *needles: str) -> None:
    assert "Traceback" not in err
    assert err.startswith("trainloop "), err
    assert ": error: " in err, err
    for needle in needles:
        assert needle in err, err


def two_runs_on_one_checkpoint_location(
    tmp_path: Path, path: str, env: dict[str, str] | None = None, storage_options: dict[str, str] | None = None
) -> None:
    """A run in ``first/`` saving to ``path``; a second, in ``second/``, pointed there while it lives.

    The second is refused in one line, exit 2, and the first run's checkpoints are all kept.
    """
    import json
    import signal

    from trainloop.checkpoint import checkpoint_steps
    from trainloop.location import location

    hook = {"type": "checkpointing", "interval": 2, "keep_previous": 1000, "path": path, "exit_signals": ["SIGTERM"]}
    settings = {"max_steps": 100_000, "workspace": "ws", "step_sleep": 0.02, "report": True, "hooks": [hook]}
    for name in ("first", "second"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "run.json").write_text(json.dumps(settings))
    first = subprocess.Popen(
        [sys.executable, "-m", "trainloop", "run", "run.json", "--trainer", "cli_trainers:CliTrainer"],
        cwd=tmp_path / "first", env=env or cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert first.stdout is not None
        if "step 5\n" not in iter(first.stdout.readline, ""):
            pytest.fail(f"the first run ended before step 5: {first.stderr.read() if first.stderr else ''}")
        second = Cli("run", "run.json", "--trainer", "cli_trainers:CliTrainer", cwd=tmp_path / "second", env=env).result()
        assert second.returncode == 2, second.stderr[-3000:]
        assert_one_clean_error(
            second.stderr, f"trainloop run: error: {path}: in use by the run of PID {first.pid} on host",
            "give another CheckpointingHook path: one checkpoint location belongs to one run",
        )
        assert len(second.stderr.splitlines()) == 1, second.stderr
        assert not (tmp_path / "second" / "ws").exists()  # the workspace the refused run made is gone again
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert first.returncode == 143
    steps = checkpoint_steps(location(path, storage_options))
    assert steps[: len(steps) - 1] == list(range(2, 2 * len(steps) - 1, 2)), steps  # none pruned, none resumed
    second = Cli("run", "run.json", "--trainer", "cli_trainers:CliTrainer", "--set", "max_steps=1", cwd=tmp_path / "second", env=env)
    assert second.result().returncode == 0  # released at the end of the run
