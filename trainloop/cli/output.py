"""Where a command's result goes: a file (``--output PATH``) or stdout."""

from __future__ import annotations

import sys
from pathlib import Path

from trainloop.cli.errors import FAILURE, CliError

__all__ = ["write_output"]


def write_output(output: str | None, data: str | bytes) -> None:
    """Write ``data`` to ``output`` if given, else to stdout (bytes: to its binary buffer).

    Raises:
        CliError: ``output`` cannot be written (exit code 1).
    """
    if output is not None:
        try:
            if isinstance(data, bytes):
                Path(output).write_bytes(data)
            else:
                Path(output).write_text(data, encoding="utf-8")
        except OSError as error:
            raise CliError(f"{output}: cannot write: {error.strerror}", FAILURE) from None
        return
    if isinstance(data, bytes):
        sys.stdout.flush()
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()
    else:
        sys.stdout.write(data)
