"""Gathering per-item outputs from every rank into one set, each item once, in dataset order.

Each rank predicted the items its ``DistributedSampler`` gave it; it knows their dataset indices and
their positions in the sampler's list over all ranks (see ``trainloop.predict.order``). The
positions at or beyond the dataset's length are the sampler's padding (repeats of its first items):
they are dropped, and the rest are put at their dataset index. That is right whether the sampler
shuffled or not, and whatever each rank's last batch held.
"""

from __future__ import annotations

import torch

from trainloop.distributed.ranks import gather_from_ranks

__all__ = ["GatherError", "gather_items"]


class GatherError(RuntimeError):
    """The ranks' outputs do not give every item of the dataset exactly once."""


def gather_items(
    outputs: dict[str, torch.Tensor], indices: torch.Tensor, positions: torch.Tensor, length: int
) -> dict[str, torch.Tensor]:
    """Every rank's outputs, padding dropped, item ``i`` of the dataset at row ``i`` (a collective).

    Every rank gets the whole result (``all_gather_object`` of CPU tensors); without a process
    group it is this rank's outputs, put in order.

    Args:
        outputs: This rank's outputs by name, one row per item, in the order it predicted them.
        indices: The dataset index of each of those items.
        positions: Each item's position in the sampler's list over all ranks.
        length: The dataset's length: positions from it on are padding.

    Raises:
        GatherError: A rank predicted another number of items than its sampler gave it (a
            loader that drops or adds items), the ranks' outputs have different names, or the
            items do not cover the dataset exactly once.
    """
    parts = gather_from_ranks((outputs, indices, positions))
    names = set(outputs)
    kept_indices, kept = [], []
    for rank, (rank_outputs, rank_indices, rank_positions) in enumerate(parts):
        rows = {value.shape[0] for value in rank_outputs.values()} or {0}
        if rows != {len(rank_indices)}:
            raise GatherError(
                f"rank {rank} predicted {sorted(rows)[0]} items, its sampler gave it {len(rank_indices)}: "
                "the predict data must yield every item its sampler draws, once"
            )
        if rank_outputs and set(rank_outputs) != names and names:
            raise GatherError(f"rank {rank}'s outputs are named {sorted(rank_outputs)}, this rank's {sorted(names)}")
        mask = rank_positions < length
        kept_indices.append(rank_indices[mask])
        kept.append({name: value[mask] for name, value in rank_outputs.items()})
    found = torch.cat(kept_indices) if kept_indices else torch.empty(0, dtype=torch.long)
    order = torch.argsort(found)
    if not torch.equal(found[order], torch.arange(length)):
        raise GatherError(
            f"the ranks predicted {len(found)} items without padding ({len(torch.unique(found))} distinct), "
            f"the dataset has {length}: the samplers do not cover it once"
        )
    names = set().union(*(part.keys() for part in kept))
    return {name: torch.cat([part[name] for part in kept if name in part])[order] for name in sorted(names)}
