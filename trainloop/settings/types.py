"""Strict, constrained field types shared by settings and hook parameters.

Strict: a string is never silently taken for a number or a boolean (``"10"`` is not ``10``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, Field

__all__ = [
    "NonEmptyPath", "NonNegativeFloat", "NonNegativeInt", "PositiveFloat", "PositiveInt", "RecordKey", "StrictBool"
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
NonEmptyPath = Annotated[Path, BeforeValidator(_not_empty)]
"""A path that is not written empty (``"."`` says the current directory)."""
RecordKey = Annotated[str, Field(strict=True), AfterValidator(_record_key)]
"""A key of ``forward``'s records, dotted for a nested one (``"tokens.input"``); never empty."""
