"""Throughput: items per second, counted on the device and read only when the statistics are emitted.

``StatsHook`` (and so ``LoggingHook`` and ``ProgressHook``) counts the items each step trained on:
the ``Loss.count`` that ``forward`` returns (``Loss(sum, count)``), or a count ``forward``
declares in its records (``items="tokens"`` reads ``records["tokens"]``). Per step it keeps
references to the counts, as it does with the losses; at an emission they are summed on their
device and read with one host sync. Steps ``torch.compile`` spent compiling are left out, their
items and their time alike.

The rate is the items over the steps' own time (``step_info.step_time``: from a step's start to
its applied update, so hooks, validations and checkpoints are not in it). With ``flops_per_item``
the model's FLOP/s follow, and with ``peak_flops`` the model-FLOPs utilisation (MFU) as nanoGPT and
PaLM define it. Across ranks (a synced hook), the items and the rates add up and the MFU averages.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from trainloop.step_info import StepInfo

__all__ = [
    "THROUGHPUT_SETTINGS",
    "ItemCount",
    "Throughput",
    "adopted_throughput",
    "combine_throughput",
    "throughput",
]


@dataclass(frozen=True)
class Throughput:
    """Items per second over the steps of one emission.

    Attributes:
        items: Items this rank trained on in the window's timed steps (compiling ones left out).
        seconds: Those steps' time on this rank.
        items_per_second: ``items / seconds``.
        flops_per_second: The model's FLOP/s (``items_per_second * flops_per_item``), when declared.
        mfu: ``flops_per_second / peak_flops``, when both are declared.
        total_items: Items over all ranks (a synced hook under a process group), else ``None``.
        total_items_per_second: The ranks' rates added up, else ``None``.
    """

    items: float
    seconds: float
    items_per_second: float
    flops_per_second: float | None = None
    mfu: float | None = None
    total_items: float | None = None
    total_items_per_second: float | None = None

    def to_records(self) -> dict[str, float]:
        """The numbers, under the keys ``metrics.jsonl`` uses (``None`` ones left out)."""
        out = {
            "items": self.items,
            "items_per_second": self.items_per_second,
            "flops_per_second": self.flops_per_second,
            "mfu": self.mfu,
            "total_items": self.total_items,
            "total_items_per_second": self.total_items_per_second,
        }
        return {key: value for key, value in out.items() if value is not None}


class ItemCount:
    """The items of a window's steps: references per step, one read per emission.

    Args:
        key: A key of ``forward``'s records holding each batch's count (dotted for a nested
            one: ``"tokens.input"``), or ``None`` for ``Loss.count``.
        owner: How errors name the hook.
    """

    def __init__(self, key: str | None, owner: str) -> None:
        self.key = key
        self._path = tuple(key.split(".")) if key else ()
        self.owner = owner
        self.counts: list[torch.Tensor | float] = []  # the window's counts: numbers, or tensors on their device

    def reset(self) -> None:
        """Start a new window."""
        self.counts = []

    def add(self, info: StepInfo, trainer: Any) -> None:
        """Add a step's counts (references: no tensor is read, nothing is summed per step).

        ``trainer`` is read only to name the step in an error.

        Raises:
            KeyError: ``key`` is declared and a microstep's records lack it.
        """
        if self.key is None:
            self.counts.extend(info.items)
        else:
            self.counts.extend([self._lookup(record, trainer) for record in info.records])

    def _lookup(self, record: Mapping[str, Any], trainer: Any) -> Any:
        value: Any = record
        for part in self._path:
            if not isinstance(value, Mapping) or part not in value:
                raise KeyError(
                    f"{self.owner}(items={self.key!r}): forward's records at step {trainer.step} have no "
                    f"{self.key!r} (keys: {sorted(record)})"
                )
            value = value[part]
        return value

    def read(self) -> float | None:
        """The window's items (one host sync when any count is a tensor), or ``None`` if no step had a count."""
        if not self.counts:
            return None
        tensors = [t if t.ndim == 0 else t.reshape(()) for t in self.counts if isinstance(t, torch.Tensor)]
        total = float(sum(n for n in self.counts if not isinstance(n, torch.Tensor)))
        if tensors:
            # Two ops for the window, whatever its length: stacked where they are (dtypes promote),
            # summed in float64 (exact for integer counts below 2**53), read once.
            total += torch.stack(tensors).detach().sum(dtype=torch.float64).item()
        return total


THROUGHPUT_SETTINGS = ("items", "flops_per_item", "peak_flops")
"""What a statistics hook is told about the items it counts: declared once, shown by every such hook."""


def adopted_throughput(own: Any, other: Any) -> dict[str, Any]:
    """The throughput settings ``own`` takes from ``other``: those it left unset and ``other`` declares.

    Raises:
        ValueError: Both declare one of them, differently (the message names it and both values).
    """
    adopted = {}
    for name in THROUGHPUT_SETTINGS:
        mine, theirs = getattr(own, name, None), getattr(other, name, None)
        if theirs is None:
            continue
        if mine is None:
            adopted[name] = theirs
        elif mine != theirs:
            said = f"{name} is {mine!r} on one and {theirs!r} on the other"
            raise ValueError(f"{said}: declare it once, on the LoggingHook")
    return adopted


def throughput(
    items: float | None, seconds: float, flops_per_item: float | None, peak_flops: float | None
) -> Throughput | None:
    """This rank's ``Throughput``, or ``None`` when nothing was counted or timed."""
    if items is None or seconds <= 0:
        return None
    rate = items / seconds
    flops = rate * flops_per_item if flops_per_item is not None else None
    mfu = flops / peak_flops if flops is not None and peak_flops is not None else None
    return Throughput(items, seconds, rate, flops, mfu)


def combine_throughput(ranks: Sequence[Throughput | None], local: Throughput | None) -> Throughput | None:
    """``local`` with the totals over ``ranks`` (every rank's ``Throughput``, gathered)."""
    counted = [t for t in ranks if t is not None]
    if local is None or not counted:
        return local
    mfus = [t.mfu for t in counted if t.mfu is not None]
    return Throughput(
        items=local.items,
        seconds=local.seconds,
        items_per_second=local.items_per_second,
        flops_per_second=local.flops_per_second,
        mfu=sum(mfus) / len(mfus) if mfus else None,
        total_items=sum(t.items for t in counted),
        total_items_per_second=sum(t.items_per_second for t in counted),
    )
