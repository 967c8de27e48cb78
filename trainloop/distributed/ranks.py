"""This process's place among the ranks.

One helper per question, each safe without a process group (then there is one rank, rank 0).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.utils.data import DistributedSampler

__all__ = [
    "agree_on_error",
    "broadcast_from_rank_zero",
    "gather_from_ranks",
    "in_process_group",
    "is_rank_zero",
    "rank",
    "sampler_problem",
    "world_size",
]


def in_process_group() -> bool:
    """Whether a default process group is initialised."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's rank in the default group; 0 without one."""
    return dist.get_rank() if in_process_group() else 0


def world_size() -> int:
    """The number of ranks in the default group; 1 without one."""
    return dist.get_world_size() if in_process_group() else 1


def is_rank_zero() -> bool:
    """Whether this process is rank 0 (also true without a process group)."""
    return rank() == 0


def gather_from_ranks(value: Any) -> list[Any]:
    """``value`` of every rank, in rank order (a collective under a process group)."""
    world = world_size()
    if world == 1:
        return [value]
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, value)
    return gathered


def broadcast_from_rank_zero(value: Any, group: Any = None) -> Any:
    """Rank 0's ``value`` on every rank (just ``value`` without a process group)."""
    if not in_process_group():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def agree_on_error(error: BaseException | None, group: Any = None) -> BaseException | None:
    """This rank's error, else the first other rank's, else ``None``: the same on every rank."""
    if not in_process_group():
        return error
    errors: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(errors, error, group=group)
    if error is not None:
        return error  # the original, with its cause
    return next((e for e in errors if e is not None), None)


def sampler_problem(sampler: DistributedSampler[Any], rank: int, world: int, what: str, padding: str) -> str | None:
    """Why ``sampler`` does not deal ``what`` (``"the predict data"``) to this rank with every item once, or ``None``.

    It must be built for this rank of this many ranks, and keep every item (``drop_last=False``, whose
    padding repeats a few items: the caller says what becomes of them in ``padding``).
    """
    if (sampler.num_replicas, sampler.rank) != (world, rank):
        return (
            f"{what}'s DistributedSampler is for rank {sampler.rank} of {sampler.num_replicas}, "
            f"this process is rank {rank} of {world}"
        )
    length = len(sampler.dataset)  # type: ignore[arg-type]
    if sampler.drop_last and length % world:
        return (
            f"{what}'s DistributedSampler has drop_last=True: it leaves out {length % world} of the "
            f"{length} items; build it with drop_last=False (its padding is {padding})"
        )
    return None
