"""Means of per-item values over a dataset evaluated on several ranks, each item counted once.

A ``DistributedSampler`` hands rank ``r`` the items at positions ``r, r + W, r + 2W, ...`` of its
list over all ``W`` ranks, which it pads to a multiple of ``W`` by repeating its first items: the
positions ``len(dataset)`` and beyond are those repeats, at most one per rank, each the last item of
one of the last ranks (as ``trainloop.distributed.gather`` drops them from predictions). An
all-reduce of sums and counts over what each rank drew counts them twice: over 7 items on 2 ranks,
item 0 twice. :class:`ItemMeans` leaves them out, so the mean is the one a single process computes.

It sums in float64 on each rank and all-reduces the float64 sums: the result differs from one
process's only by the order of float64 additions (about 1e-15 relative). The per-item values are
the model's own: a batch of other items may round them differently in float32 (about 1e-7).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

from trainloop.distributed.ranks import gather_from_ranks, rank, sampler_problem, world_size

__all__ = ["ItemMeans", "ItemMeansError"]

#: One value per item (``[batch, ...]``), or per item a sum and the count it covers (two ``[batch]`` tensors).
ItemValues = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


class ItemMeansError(ValueError):
    """The data or the values cannot give the mean over every item of the dataset once."""


class ItemMeans:
    """The means of per-item values over every item of ``data`` once, on any number of ranks.

    Build one per evaluation over the loader it iterates, add each batch's per-item values, and
    reduce: on several ranks the ``DistributedSampler``'s padding is left out, so every rank gets
    the numbers one process gets over the whole dataset::

        def val_metrics(self):
            means = ItemMeans(self.val_loader)
            for x, y in self.val_loader:
                logits = self.model(x.to(self.device))
                y = y.to(self.device)
                means.add(loss=F.cross_entropy(logits, y, reduction="none"), accuracy=logits.argmax(1) == y)
            return means.reduce()  # {"loss": ..., "accuracy": ...}

    A value is a tensor with one row per item of the batch, in the order the loader gave them
    (``[batch]``, or ``[batch, ...]``: the mean is then over every element, as a ``mean`` over the
    whole set); or a pair ``(sums, counts)`` of ``[batch]`` tensors, one sum and the number of
    elements it covers per item (tokens of a sequence): the mean is the sum of the sums over the sum
    of the counts. Sums and counts stay on the values' device until :meth:`reduce`.

    Args:
        data: The loader the values come from: under several ranks a ``DataLoader`` with a
            ``DistributedSampler`` for this rank (shuffled or not); in one process any iterable.

    Raises:
        ItemMeansError: Under several ranks the data has no ``DistributedSampler`` for them, or
            it leaves items out (``drop_last``).
    """

    def __init__(self, data: Iterable[Any]) -> None:
        self._world = world_size()
        self._rank = rank()
        sampler = _distributed_sampler(data)
        #: The items this rank's sampler gives it, and how many of them are not padding.
        self._expected: int | None = None
        self._real: int | None = None
        if sampler is not None:
            length = _checked_length(data, sampler, self._rank, self._world)
            self._expected = sampler.num_samples
            self._real = len(range(self._rank, length, self._world))  # positions r, r + W, ... below length
        elif self._world > 1:
            raise ItemMeansError(
                f"ItemMeans under {self._world} ranks needs a DataLoader with a DistributedSampler (shuffled or not), "
                f"so that every item counts once; the data is {_describe(data)}"
            )
        self._added: dict[str, int] = {}
        self._sums: dict[str, torch.Tensor] = {}
        self._counts: dict[str, torch.Tensor | int] = {}  # an int while only plain values were added: no copy

    def add(self, **values: ItemValues) -> None:
        """Add the per-item values of the next items of this rank's data, by name.

        Each name counts its own items, so names may be added in separate calls.

        Raises:
            ItemMeansError: A value is not one per item (a 0-d tensor, e.g. a batch's mean), or a
                pair whose sums and counts do not have one entry per item each.
        """
        for name, value in values.items():
            sums, counts = _per_item(name, value)
            items = sums.shape[0]
            done = self._added.get(name, 0)
            self._added[name] = done + items
            keep = items if self._real is None else min(items, max(0, self._real - done))
            kept = sums[:keep].detach()
            if kept.device.type == "mps":  # no float64 there
                kept, counts = kept.cpu(), None if counts is None else counts.cpu()
            total = kept.sum(dtype=torch.float64)
            count = kept.numel() if counts is None else counts[:keep].detach().sum(dtype=torch.float64)
            self._sums[name] = self._sums[name] + total if name in self._sums else total
            self._counts[name] = self._counts.get(name, 0) + count

    def reduce(self) -> dict[str, float]:
        """The mean of each name over every item, the same on every rank (every rank must call it).

        Under a process group: one ``all_gather_object`` of each rank's names and item counts, then
        one float64 ``all_reduce`` of the sums and counts. A mean over no element is NaN.

        Raises:
            ItemMeansError: The ranks added other names, or a rank added another number of items
                than its sampler gives it (every item it draws, padding included, once) — on every
                rank, before the sums are reduced.
        """
        added = dict(sorted(self._added.items()))
        problem = _problem(gather_from_ranks(added), self._expected)
        if problem is not None:
            raise ItemMeansError(problem)
        names = list(added)
        if not names:
            return {}
        device = self._sums[names[0]].device
        counts = [torch.as_tensor(self._counts[n], dtype=torch.float64).to(device) for n in names]
        totals = torch.stack([*(self._sums[n].to(device) for n in names), *counts])
        if self._world > 1:
            dist.all_reduce(totals)
        found = totals.tolist()
        return {n: found[i] / found[len(names) + i] if found[len(names) + i] else math.nan for i, n in enumerate(names)}


def _distributed_sampler(data: Iterable[Any]) -> DistributedSampler[Any] | None:
    """``data``'s ``DistributedSampler``: the sampler itself, a loader's, or its batch sampler's."""
    if isinstance(data, DistributedSampler):
        return data
    if not isinstance(data, DataLoader):
        return None
    if isinstance(data.sampler, DistributedSampler):
        return data.sampler
    batches = data.batch_sampler
    if isinstance(batches, BatchSampler) and isinstance(batches.sampler, DistributedSampler):
        return batches.sampler
    return None


def _checked_length(data: Iterable[Any], sampler: DistributedSampler[Any], rank: int, world: int) -> int:
    """The dataset's length, once the sampler is known to be this rank's and to give every item."""
    problem = sampler_problem(sampler, rank, world, "ItemMeans: the data", "left out of the means")
    if problem is not None:
        raise ItemMeansError(problem)
    length = len(sampler.dataset)  # type: ignore[arg-type]
    left_out = sampler.num_samples % data.batch_size if isinstance(data, DataLoader) and data.batch_size else 0
    if left_out and isinstance(data, DataLoader) and data.drop_last:
        raise ItemMeansError(
            f"ItemMeans: the DataLoader has drop_last=True: it leaves out the last {left_out} of this rank's "
            f"{sampler.num_samples} items; build it with drop_last=False"
        )
    return length


def _per_item(name: str, value: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``value`` as per-item sums (one row per item) and, for a pair, per-item counts."""
    if isinstance(value, tuple) and len(value) == 2 and all(isinstance(v, torch.Tensor) for v in value):
        sums, counts = value
        if sums.dim() != 1 or counts.shape != sums.shape:
            raise ItemMeansError(
                f"ItemMeans.add({name}=(sums, counts)): sums and counts need one entry per item, two [batch] tensors; "
                f"got shapes {list(sums.shape)} and {list(counts.shape)}"
            )
        return sums, counts
    if not isinstance(value, torch.Tensor):
        raise ItemMeansError(
            f"ItemMeans.add({name}=...): a value is a tensor with one row per item or a pair (sums, counts) of them, "
            f"not a {type(value).__name__}"
        )
    if value.dim() == 0:
        raise ItemMeansError(
            f"ItemMeans.add({name}=...): one value per item is needed, a tensor of shape [batch, ...]; got a 0-d "
            "tensor (a batch's mean? compute it with reduction='none')"
        )
    return value, None


def _problem(parts: list[dict[str, int]], expected: int | None) -> str | None:
    """What is wrong with the ranks' names and item counts (``parts[r]``: rank r's), or ``None``."""
    names = [sorted(part) for part in parts]
    for r, found in enumerate(names):
        if found != names[0]:
            return f"ItemMeans: rank {r} added {found}, rank 0 added {names[0]}: every rank must add the same names"
    if expected is None:
        return None
    for r, part in enumerate(parts):
        for name, items in part.items():
            if items != expected:
                return (
                    f"ItemMeans: rank {r} added {items} items of {name!r}, its DistributedSampler gives it {expected}: "
                    "add every item the loader gives, once (the padding is left out of the means)"
                )
    return None


def _describe(data: Any) -> str:
    if isinstance(data, DataLoader):
        return f"a DataLoader with a {type(data.sampler).__name__}"
    return f"a {type(data).__name__}"
