"""Nested records: the dicts of numbers ``forward`` returns and hooks aggregate and log."""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Iterable, Mapping
from numbers import Number
from typing import Any, TypeAlias, Union

import torch

__all__ = [
    "Records",
    "flatten_nested_dict",
    "hint_for_missing_key",
    "key_average",
    "map_nested_tensor",
    "to_float",
]

Records: TypeAlias = dict[str, Union[int, float, torch.Tensor, "Records"]]
"""A nested dict of numbers (or scalar tensors), as ``forward`` returns and hooks log."""


def map_nested_tensor(fn: Callable[[torch.Tensor], Any], obj: Any) -> Any:
    """Apply ``fn`` to every tensor inside nested dicts, lists and tuples (named tuples too).

    Anything that is not a tensor or a container is returned as it is, so a batch can be moved
    to a device with ``map_nested_tensor(lambda t: t.to(device), batch)``.
    """
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, Mapping):
        return type(obj)((k, map_nested_tensor(fn, v)) for k, v in obj.items())  # type: ignore[call-arg]
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # named tuple
        return type(obj)(*(map_nested_tensor(fn, v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_nested_tensor(fn, v) for v in obj)
    return obj


def to_float(value: Any, key: str) -> float:
    """A record's value as a Python float (a host sync for a tensor); errors name the ``key``.

    Raises:
        TypeError: The value is not a number or a tensor.
        ValueError: The tensor has more than one element.
    """
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"record {key!r} is a tensor of shape {tuple(value.shape)}, not a scalar")
        return float(value.item())
    if isinstance(value, Number) and not isinstance(value, complex):
        return float(value)  # type: ignore[arg-type]
    raise TypeError(f"record {key!r} is a {type(value).__name__}, not a number")


def key_average(records: Iterable[Mapping[str, Any]], exclude_nan: bool = False) -> Records:
    """Average nested records key by key.

    A key missing from some records is averaged over the records that have it. With
    ``exclude_nan``, NaN values are left out of their key's average (a key that is NaN
    everywhere stays NaN).

    Raises:
        TypeError: A value is neither a number nor a scalar tensor (the message names the key).
    """
    sums: dict[str, Any] = {}
    for record in records:
        _accumulate(sums, record, exclude_nan, prefix="")
    return _divide(sums)


def _accumulate(sums: dict[str, Any], record: Mapping[str, Any], exclude_nan: bool, prefix: str) -> None:
    for key, value in record.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping):
            _accumulate(sums.setdefault(key, {}), value, exclude_nan, prefix=f"{path}/")
            continue
        number = to_float(value, path)
        total, count, nan_seen = sums.get(key, (0.0, 0, False))
        if exclude_nan and math.isnan(number):
            sums[key] = (total, count, True)
        else:
            sums[key] = (total + number, count + 1, nan_seen)


def _divide(sums: dict[str, Any]) -> Records:
    result: Records = {}
    for key, value in sums.items():
        if isinstance(value, dict):
            result[key] = _divide(value)
        else:
            total, count, _ = value
            result[key] = total / count if count else math.nan
    return result


def flatten_nested_dict(d: Mapping[str, Any], sep: str = "/", prefix: str = "") -> dict[str, Any]:
    """Flatten nested dicts into one level: ``{"a": {"b": 1}}`` becomes ``{"a/b": 1}``."""
    flat: dict[str, Any] = {}
    for key, value in d.items():
        name = f"{prefix}{sep}{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            flat.update(flatten_nested_dict(value, sep, name))
        else:
            flat[name] = value
    return flat


def hint_for_missing_key(key: str, seen: Iterable[str]) -> str:
    """A hint for a key that was never seen among ``seen``.

    ``"; did you mean 'val/loss'?"``, else the keys seen (at most 20), else ``""``.
    """
    seen = sorted(set(seen))
    close = difflib.get_close_matches(key, seen, n=3)
    if close:
        return f"; did you mean {' or '.join(repr(k) for k in close)}?"
    if seen:
        return f"; keys logged: {', '.join(seen[:20])}"
    return ""
