"""A Python script run in a child process, driven line by line (shared by the process tests)."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
from pathlib import Path

#: What hides the CUDA devices from a process (read when it first asks torch for them): the ranks a
#: test means to run on the CPU get it, so that two of them never share a GPU under NCCL.
HIDDEN_GPUS = {"CUDA_VISIBLE_DEVICES": ""}

SUPPORT = Path(__file__).resolve().parent  # tests/support: the test helpers
REPO = SUPPORT.parents[1]


class ChildProcess:
    """``script`` in a subprocess with tests/ and the repository on its path; stdout read on a
    thread, stderr kept in a file (shown when it ends unexpectedly).

    Args:
        script: The script to run.
        args: Its arguments.
        tmp: Where its stderr file goes.
        env: Extra environment variables.
    """

    def __init__(self, script: Path | str, args: list[str], tmp: Path, env: dict[str, str] | None = None) -> None:
        full_env = dict(os.environ)
        full_env["PYTHONPATH"] = os.pathsep.join([str(SUPPORT), str(REPO), *filter(None, [full_env.get("PYTHONPATH")])])
        full_env.update(env or {})
        self.stderr_path = tmp / f"stderr-{os.urandom(4).hex()}.txt"
        with open(self.stderr_path, "w") as stderr:
            self.proc = subprocess.Popen(
                [sys.executable, str(script), *args],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True, env=full_env,
            )
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            self._queue.put(line.strip())
        self._queue.put(None)

    def stderr(self) -> str:
        """What it wrote to stderr so far."""
        return self.stderr_path.read_text()

    def send(self, line: str) -> None:
        """Write one line to its stdin."""
        self.proc.stdin.write(line + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]

    def wait_for(self, prefix: str, count: int = 1, timeout: float = 120, exact: bool = False) -> str:
        """Block until the ``count``-th new line starting with ``prefix`` (equal to it, with
        ``exact``); return it."""
        seen = 0
        while True:
            try:
                line = self._queue.get(timeout=timeout)
            except queue.Empty:
                self.proc.kill()
                raise AssertionError(f"no {prefix!r} line in {timeout} s: {self.lines}") from None
            if line is None:
                raise AssertionError(f"child ended before {prefix!r}: {self.lines}\n{self.stderr()}")
            self.lines.append(line)
            if line == prefix if exact else line.startswith(prefix):
                seen += 1
                if seen == count:
                    return line

    def finish(self, timeout: float = 120) -> int:
        """Wait for the exit; read the remaining lines; return the exit code."""
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        while (line := self._queue.get(timeout=timeout)) is not None:
            self.lines.append(line)
        return code
