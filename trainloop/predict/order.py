"""Where each predicted item belongs: its index in the dataset, read from the loader's sampler.

A ``DataLoader`` over a ``DistributedSampler`` hands rank ``r`` the items at positions
``r, r + W, r + 2W, ...`` of the sampler's list of dataset indices (``W`` ranks; shuffled or not),
which it pads to ``total_size`` by repeating its first indices so that every rank gets as many.
Iterating the sampler again gives the same list (it is drawn from ``seed + epoch``), so the rank
knows, before it predicts, the dataset index of each item it will predict and which positions are
padding (those at ``total_size - len(dataset)`` and beyond). A ``SequentialSampler`` yields
``0, 1, 2, ...``. Any other loader (a shuffling ``RandomSampler``, an ``IterableDataset``, a
generator) has no known order: a single process writes its items in the order they came, and
several ranks refuse it (no way to put their items in order, nor to know whether they overlap).
"""

from __future__ import annotations

from collections.abc import Iterable, Sized
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler, SequentialSampler

from trainloop.distributed.ranks import sampler_problem

__all__ = ["ItemOrder", "PredictDataError", "item_order"]


class PredictDataError(ValueError):
    """The predict data cannot give every item once, in a known order."""


@dataclass(frozen=True)
class ItemOrder:
    """The dataset index of each item this rank will predict, in the order it will predict them.

    Attributes:
        indices: This rank's dataset indices, padding included.
        positions: Each of those items' position in the sampler's list over all ranks
            (``i * W + r``); positions at or beyond ``length`` are the sampler's padding.
        length: The number of items in the dataset.
    """

    indices: torch.Tensor
    positions: torch.Tensor
    length: int


def item_order(loader: Iterable[Any], rank: int, world_size: int) -> ItemOrder | None:
    """The order in which ``loader`` hands this rank its items (see the module's docstring).

    ``None`` when it is not known (one process only): the items are written in the order the
    loader yields them.

    Args:
        loader: The predict data.
        rank: This process's rank.
        world_size: The number of ranks.

    Raises:
        PredictDataError: Under several ranks, the loader has no ``DistributedSampler`` over them;
            or the loader would leave items out (``drop_last``).
    """
    sampler = loader.sampler if isinstance(loader, DataLoader) else None
    if isinstance(sampler, DistributedSampler):
        return _distributed_order(loader, sampler, rank, world_size)  # type: ignore[arg-type]
    if world_size > 1:
        raise PredictDataError(
            f"predict under {world_size} ranks needs a DataLoader with a DistributedSampler (shuffled or not), so "
            f"that every item is predicted once and its place is known; the predict data is "
            f"{_describe(loader)}"
        )
    if isinstance(sampler, SequentialSampler) and isinstance(sampler.data_source, Sized):
        length = len(sampler.data_source)
        _refuse_a_dropped_batch(loader, length)  # type: ignore[arg-type]
        return ItemOrder(torch.arange(length), torch.arange(length), length)
    return None


def _distributed_order(loader: DataLoader[Any], sampler: DistributedSampler[Any], rank: int, world: int) -> ItemOrder:
    problem = sampler_problem(sampler, rank, world, "the predict data", "removed from the predictions")
    if problem is not None:
        raise PredictDataError(problem)
    length = len(sampler.dataset)  # type: ignore[arg-type]
    indices = torch.tensor(list(iter(sampler)), dtype=torch.long)
    _refuse_a_dropped_batch(loader, len(indices))
    positions = torch.arange(len(indices)) * world + rank
    return ItemOrder(indices, positions, length)


def _refuse_a_dropped_batch(loader: DataLoader[Any], items: int) -> None:
    size = loader.batch_size
    if loader.drop_last and size and items % size:
        raise PredictDataError(
            f"the predict DataLoader has drop_last=True: it leaves out the last {items % size} of its {items} "
            "items; build it with drop_last=False"
        )


def _describe(loader: Any) -> str:
    if isinstance(loader, DataLoader):
        return f"a DataLoader with a {type(loader.sampler).__name__}"
    return f"a {type(loader).__name__}"
