"""Strict, constrained field types shared by settings and hook parameters.

Strict: a string is never silently taken for a number or a boolean (``"10"`` is not ``10``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, Field, PlainValidator
from pydantic_core import PydanticCustomError

from trainloop.location import is_url, lost_slash

__all__ = [
    "NonEmptyPath",
    "WorkspacePath",
    "NonNegativeFloat",
    "NonNegativeInt",
    "PathOrUrl",
    "PositiveFloat",
    "PositiveInt",
    "RecordKey",
    "StrictBool",
]


def _not_empty(value: Any) -> Any:
    # Path("") is Path("."): an empty value (``--set workspace=``, an unset variable in a file)
    # would silently mean the current directory.
    if isinstance(value, (str, bytes)) and not value.strip():
        raise ValueError("an empty path; give a directory (\".\" for the current one)")
    return value


def _record_key(value: str) -> str:
    # "" or "a..b" would look up no key at all: the whole record, or nothing, at the first emission.
    if not value.strip():
        raise ValueError("an empty key: give a key of forward's records (dotted for a nested one: tokens.input)")
    if any(not part.strip() for part in value.split(".")):
        raise ValueError(f"{value!r} has an empty part between its dots: give a key such as tokens.input")
    return value


PositiveInt = Annotated[int, Field(gt=0, strict=True)]
NonNegativeInt = Annotated[int, Field(ge=0, strict=True)]
PositiveFloat = Annotated[float, Field(gt=0, strict=True, allow_inf_nan=False)]
NonNegativeFloat = Annotated[float, Field(ge=0, strict=True, allow_inf_nan=False)]
StrictBool = Annotated[bool, Field(strict=True)]
def _local_path(value: Any) -> Any:
    # Path("s3://b/x") is the local folder "s3:/b/x": a URL given where only a local path works
    # would silently become one.
    value = _not_empty(value)
    if is_url(value):
        raise ValueError("a URL, where a local path is needed")
    if isinstance(value, (str, Path)):
        problem = lost_slash(Path(value))
        if problem is not None:
            raise ValueError(problem)
    return value


def _workspace(value: Any) -> Any:
    if is_url(value) or (isinstance(value, (str, Path)) and lost_slash(Path(value)) is not None):
        raise ValueError(
            "a URL, and a workspace is a local directory (it holds the run's lock, logs and runs.jsonl); "
            "put checkpoints on object storage with CheckpointingHook(path=<url>)"
        )
    return _local_path(value)


NonEmptyPath = Annotated[Path, BeforeValidator(_local_path)]
"""A local path that is not written empty (``"."`` says the current directory), nor as a URL."""
WorkspacePath = Annotated[Path, BeforeValidator(_workspace)]
"""A run's workspace: a local directory (:data:`NonEmptyPath`), refused as a URL with the reason."""


def _path_or_url(value: Any) -> Path | str:
    value = _not_empty(value)
    if is_url(value):
        return str(value)  # a URL stays text: Path("s3://b/x") would be the local folder "s3:/b/x"
    if not isinstance(value, (str, Path)):
        raise PydanticCustomError("path_type", "Input should be a path or a URL")
    problem = lost_slash(Path(value))
    if problem is not None:
        raise ValueError(problem)
    return Path(value)


PathOrUrl = Annotated[Path | str, PlainValidator(_path_or_url, json_schema_input_type=str)]
"""A local path (a :class:`~pathlib.Path`) or an fsspec URL (``s3://bucket/run``, kept as text)."""
RecordKey = Annotated[str, Field(strict=True), AfterValidator(_record_key)]
"""A key of ``forward``'s records, dotted for a nested one (``"tokens.input"``); never empty."""
