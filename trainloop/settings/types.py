"""Strict, constrained field types shared by settings and hook parameters.

Strict: a string is never silently taken for a number or a boolean (``"10"`` is not ``10``).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

__all__ = ["NonNegativeFloat", "NonNegativeInt", "PositiveFloat", "PositiveInt", "StrictBool"]

PositiveInt = Annotated[int, Field(gt=0, strict=True)]
NonNegativeInt = Annotated[int, Field(ge=0, strict=True)]
PositiveFloat = Annotated[float, Field(gt=0, strict=True, allow_inf_nan=False)]
NonNegativeFloat = Annotated[float, Field(ge=0, strict=True, allow_inf_nan=False)]
StrictBool = Annotated[bool, Field(strict=True)]
