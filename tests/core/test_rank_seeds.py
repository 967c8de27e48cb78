"""Seeds per rank: the identical-batch check at the first step of a 2-rank gloo DDP run, and
``seed_per_rank``, declared as a user would."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from ddp_worker import free_port
from pydantic import ValidationError
from weights_worker import identical_batches

from trainloop import TrainerSettings
from trainloop.core.rank_seeds import batch_digest


@pytest.fixture(scope="module")
def seen(tmp_path_factory):
    out = tmp_path_factory.mktemp("identical")
    mp.spawn(identical_batches, args=(2, free_port(), str(out)), nprocs=2, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)]


def test_a_global_generator_loader_seeded_alike_warns_once_on_rank_zero(seen):
    assert seen[0]["get_batch"] == [
        "all 2 ranks drew the same first batch: they train on identical data. A loader that samples with torch's "
        "global generator draws alike on every rank, which `seed` seeds alike; shard the data with a "
        "DistributedSampler, or set seed_per_rank to offset the generators by rank"
    ]
    assert seen[1]["get_batch"] == []  # every rank would say the same: rank 0 says it once


def test_no_warning_with_seed_per_rank_or_a_distributed_sampler(seen):
    for rank_seen in seen:
        assert rank_seen["get_batch_seed_per_rank"] == []
        assert rank_seen["distributed_sampler"] == []


def test_seed_per_rank_needs_a_seed():
    with pytest.raises(ValidationError, match="seed_per_rank offsets the seed by rank: set seed too"):
        TrainerSettings(max_steps=1, seed_per_rank=True)


def test_the_batch_digest_sees_contents_dtype_and_nesting():
    a = {"x": torch.arange(4), "y": [torch.ones(2), 3]}
    assert batch_digest(a) == batch_digest({"y": [torch.ones(2), 3], "x": torch.arange(4)})
    assert batch_digest(a) != batch_digest({"x": torch.arange(4).float(), "y": [torch.ones(2), 3]})
    assert batch_digest(a) != batch_digest({"x": torch.arange(4), "y": [torch.ones(2), 4]})
