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
