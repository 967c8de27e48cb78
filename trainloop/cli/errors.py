"""What every command reports the same way: the program's name, its exit codes, and ``CliError``.

Imports nothing heavy: ``trainloop.cli`` catches ``CliError`` before any command is imported.
"""

from __future__ import annotations

__all__ = ["FAILURE", "PROG", "USAGE_ERROR", "CliError"]

PROG = "trainloop"
USAGE_ERROR = 2
FAILURE = 1


class CliError(Exception):
    """An error the command line reports as one message and an exit code, without a traceback.

    Args:
        message: What went wrong, naming the file, field or argument; one line per problem.
        exit_code: The process's exit code (2: usage, 1: a file cannot be used).
    """

    def __init__(self, message: str, exit_code: int = USAGE_ERROR) -> None:
        super().__init__(message)
        self.exit_code = exit_code
