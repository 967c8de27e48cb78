"""Seeds per rank, made explicit.

The ``seed_per_rank`` offset, and the first-step check that warns when every rank drew the same batch.

``seed`` seeds every rank alike: right for model initialisation (every replica starts equal)
and for a ``DistributedSampler`` (every rank must agree on the permutation it splits), wrong
for a loader that samples with torch's global generator (nanoGPT's ``get_batch``): every rank
then trains on the same batch, and DDP averages identical gradients. ``seed_per_rank`` reseeds
the generators with ``seed + rank`` once the model is built, so dropout and such loaders differ
per rank while the model's initialisation does not.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import torch

from trainloop.core.rng import seed_all
from trainloop.distributed.ranks import gather_from_ranks, rank, world_size
from trainloop.utils import warn_user

__all__ = ["IdenticalBatchesWarning", "batch_digest", "seed_ranks_apart", "warn_if_ranks_drew_the_same"]


class IdenticalBatchesWarning(UserWarning):
    """Every rank of a distributed run drew the same first batch."""


def seed_ranks_apart(seed: int) -> None:
    """Reseed Python's, NumPy's and torch's generators with ``seed + rank``.

    Called after the model is built, so every replica's initialisation stays the same.
    """
    seed_all(seed + rank())


def batch_digest(batch: Any) -> str:
    """A hash of a batch's contents.

    Tensors (copied to the CPU, once), numbers, strings, nested in lists, tuples and dicts.
    """
    digest = hashlib.sha256()
    for leaf in _leaves(batch):
        if isinstance(leaf, torch.Tensor):
            tensor = leaf.detach().cpu().contiguous()
            digest.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
            digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
        else:
            digest.update(repr(leaf).encode())
    return digest.hexdigest()[:16]


def _leaves(value: Any) -> Iterator[Any]:
    if isinstance(value, dict):
        for key in sorted(value, key=str):
            yield key
            yield from _leaves(value[key])
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _leaves(item)
    else:
        yield value


def warn_if_ranks_drew_the_same(batch: Any) -> None:
    """Warn once if every rank's first batch is the same, under a process group of 2+ ranks.

    Gathers a hash of each rank's first batch (one small all-gather). Every rank must call it.
    """
    if world_size() < 2:
        return
    digests = gather_from_ranks(batch_digest(batch))
    if len(set(digests)) == 1:
        warn_user(
            f"all {len(digests)} ranks drew the same first batch: they train on identical data. A loader that "
            "samples with torch's global generator draws alike on every rank, which `seed` seeds alike; shard the "
            "data with a DistributedSampler, or set seed_per_rank to offset the generators by rank",
            IdenticalBatchesWarning,
        )
