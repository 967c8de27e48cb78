"""What every command reports the same way: the program's name, its exit codes, and ``CliError``.

Imports nothing heavy: ``trainloop.cli`` catches ``CliError`` before any command is imported.
"""

from __future__ import annotations

__all__ = ["FAILURE", "PROG", "USAGE_ERROR", "CliError", "storage_failure"]

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


#: Where the errors of object storage come from: fsspec and the cloud filesystems, their clients.
_STORAGE_MODULES = ("fsspec", "s3fs", "gcsfs", "adlfs", "botocore", "aiobotocore", "aiohttp", "google.")


def storage_failure(error: BaseException) -> str | None:
    """One line for an error of object storage that no command could foresee, else ``None``.

    An endpoint that cannot be reached, credentials refused, a bucket that does not exist: raised
    by the filesystem's client wherever the run first touches the URL, they say what the client
    said, and where to look.
    """
    seen: BaseException | None = error
    while seen is not None:
        module = type(seen).__module__ + "."
        missing_bucket = isinstance(seen, FileNotFoundError) and "bucket does not exist" in str(seen)
        if missing_bucket or module.startswith(_STORAGE_MODULES):
            said = (str(seen).strip().splitlines() or [""])[0]
            bucket = _bucket_named(seen)
            return (
                f"object storage: {type(seen).__name__}: {said}{f': {bucket!r}' if bucket else ''} (check the URL, "
                "its storage_options or FSSPEC_<PROTOCOL>_* variables, and the credentials)"
            )
        seen = seen.__cause__ or seen.__context__
    return None


def _bucket_named(error: BaseException) -> str | None:
    """The bucket the storage's answer names (an S3 error's ``BucketName``) in ``error`` or its causes."""
    seen: BaseException | None = error
    while seen is not None:
        response = getattr(seen, "response", None)
        said = response.get("Error") if isinstance(response, dict) else None
        if isinstance(said, dict) and isinstance(said.get("BucketName"), str):
            return str(said["BucketName"])
        seen = seen.__cause__ or seen.__context__
    return None
