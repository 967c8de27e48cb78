"""A DataLoader's position carried to another number of ranks or another batch size, in one process.

Ranks are simulated by one ``DistributedSampler(num_replicas=..., rank=...)`` per rank; the
position goes from the stopped iterators to the new ones as a checkpoint carries it (another
rank's: without the per-rank ``epoch_start``). The global order is what a ``DistributedSampler``
documents: ``torch.randperm`` from a generator seeded with ``seed + epoch`` (or ``range``).
"""

from __future__ import annotations

import warnings
from collections import Counter

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler, RandomSampler, WeightedRandomSampler

from trainloop.core.data import EpochIterator, InexactResumeWarning

SEED = 5


class Indices(Dataset):
    """Item ``i`` is ``i``: a batch shows which samples it holds."""

    def __init__(self, length):
        self.length = length

    def __len__(self):
        return self.length

    def __getitem__(self, index):
        return index


def distributed(length, ranks, rank, batch, shuffle=True, cut=False, drop_last=False, **kwargs):
    sampler = DistributedSampler(Indices(length), num_replicas=ranks, rank=rank, shuffle=shuffle, seed=SEED, drop_last=cut)
    return DataLoader(Indices(length), batch_size=batch, sampler=sampler, drop_last=drop_last, **kwargs)


def global_order(length, epoch, shuffle=True):
    if not shuffle:
        return list(range(length))
    return torch.randperm(length, generator=torch.Generator().manual_seed(SEED + epoch)).tolist()


def draw(iterator, n):
    return [next(iterator).tolist() for _ in range(n)]


def rest_of_epoch(iterator):
    batches = []
    while iterator.remaining:
        batches.append(next(iterator).tolist())
    return batches


def carried(position):
    """What a checkpoint gives a rank of another number of ranks: the global part of any rank's position."""
    return {**position, "epoch_start": None}


def stop_and_resume(stopped, resumed_loaders, drawn, epoch=1, same_ranks=False):
    """Draw ``drawn`` batches on every stopped rank, then resume each new rank from rank 0's position."""
    iterators = [EpochIterator(loader, epoch=epoch) for loader in stopped]
    first = [draw(iterator, drawn) for iterator in iterators]
    positions = [iterator.position() for iterator in iterators]
    resumed = [
        EpochIterator(loader, epoch=epoch, resumed=True, position=positions[r] if same_ranks else carried(positions[0]))
        for r, loader in enumerate(resumed_loaders)
    ]
    return first, positions, resumed


def microstep_chunks(rest, ranks, batch, drop_last):
    """What each microstep draws over all ranks when the rest of the order is dealt over ``ranks``: consecutive chunks."""
    per_rank = len(rest) // ranks
    full = per_rank // batch
    chunks = [rest[j * batch * ranks : (j + 1) * batch * ranks] for j in range(full)]
    if per_rank % batch and not drop_last:
        chunks.append(rest[full * batch * ranks :])
    return chunks


CONFIGS = [
    # length, ranks and batch before, ranks and batch after, batches drawn before the stop, shuffle, cut, drop_last
    (48, 2, 6, 3, 4, 2, True, False, False),
    (48, 2, 6, 1, 12, 2, True, False, False),
    (48, 2, 6, 3, 2, 3, False, False, False),
    (49, 2, 6, 3, 2, 2, True, False, False),
    (49, 2, 6, 3, 2, 2, True, True, False),
    (49, 2, 6, 3, 4, 2, False, True, True),
    (50, 2, 4, 3, 4, 3, True, False, True),
    (50, 3, 4, 2, 6, 1, True, True, False),
    (49, 2, 6, 1, 12, 3, False, True, False),
    (49, 1, 12, 2, 6, 3, True, False, False),
]


@pytest.mark.parametrize(("length", "n", "bn", "m", "bm", "drawn", "shuffle", "cut", "drop_last"), CONFIGS)
def test_the_rest_of_the_epoch_is_dealt_over_the_new_ranks_in_the_global_order(
    length, n, bn, m, bm, drawn, shuffle, cut, drop_last
):
    stopped = [distributed(length, n, r, bn, shuffle, cut) for r in range(n)]
    after = [distributed(length, m, r, bm, shuffle, cut, drop_last) for r in range(m)]
    first, positions, resumed = stop_and_resume(stopped, after, drawn)
    order = global_order(length, 1, shuffle)
    consumed = drawn * bn * n
    assert positions[0]["consumed"] == consumed
    assert sorted(i for rank in first for batch in rank for i in batch) == sorted(order[:consumed])

    # The rest, padded with its own first samples or cut to a multiple of the new ranks, as a
    # DistributedSampler does with a whole epoch; each microstep draws its next chunk.
    rest = order[consumed:]
    rest = rest[: len(rest) - len(rest) % m] if cut else rest + rest[: -len(rest) % m]
    per_rank = [rest_of_epoch(iterator) for iterator in resumed]
    microsteps = [sorted(i for rank in per_rank for i in rank[j]) for j in range(len(per_rank[0]))]
    assert microsteps == [sorted(chunk) for chunk in microstep_chunks(rest, m, bm, drop_last)]

    # Then the next epoch is the new sampler's own.
    for iterator, loader in zip(resumed, [distributed(length, m, r, bm, shuffle, cut, drop_last) for r in range(m)]):
        loader.sampler.set_epoch(2)
        assert next(iterator).tolist() == next(iter(loader)).tolist()
        assert iterator.epoch == 2


def test_every_sample_of_an_epoch_is_drawn_once_across_two_changes_of_ranks():
    # 2 ranks -> 3 ranks, stopped again within the epoch they resumed -> 1 rank.
    iterators = [EpochIterator(distributed(48, 2, r, 6)) for r in range(2)]
    seen = [i for iterator in iterators for batch in draw(iterator, 1) for i in batch]
    position = iterators[0].position()
    threes = [EpochIterator(distributed(48, 3, r, 2), resumed=True, position=carried(position)) for r in range(3)]
    seen += [i for iterator in threes for batch in draw(iterator, 5) for i in batch]
    assert threes[0].position()["consumed"] == 12 + 5 * 2 * 3
    assert threes[0].position()["epoch_start"] is None  # a dealt epoch is not replayed per rank
    one = EpochIterator(distributed(48, 1, 0, 12), resumed=True, position=carried(threes[0].position()))
    seen += [i for batch in rest_of_epoch(one) for i in batch]
    assert Counter(seen) == Counter(range(48))


def test_as_many_ranks_with_another_batch_size_is_dealt_too():
    # The same 2 ranks, batch 4 instead of 8 (twice the accumulation): the per-rank replay
    # would skip batches of the wrong size.
    first, positions, resumed = stop_and_resume(
        [distributed(64, 2, r, 8) for r in range(2)], [distributed(64, 2, r, 4) for r in range(2)], 2, same_ranks=True
    )
    assert positions[0]["epoch_start"] is not None
    assert positions[0]["batch_size"] == 8
    order = global_order(64, 1)
    rest = [i for iterator in resumed for batch in rest_of_epoch(iterator) for i in batch]
    assert sorted(rest) == sorted(order[32:])


def test_as_many_ranks_with_the_same_batch_size_replay_each_rank_as_before():
    unbroken = [rest_of_epoch(EpochIterator(distributed(40, 2, r, 4))) for r in range(2)]
    first, _, resumed = stop_and_resume(
        [distributed(40, 2, r, 4) for r in range(2)], [distributed(40, 2, r, 4) for r in range(2)], 2, epoch=0,
        same_ranks=True,
    )
    assert [f + rest_of_epoch(iterator) for f, iterator in zip(first, resumed)] == unbroken


def single_process_loader(kind, length=40, batch=8):
    if kind == "global generator":
        return DataLoader(Indices(length), batch_size=batch, shuffle=True)
    if kind == "loader generator":
        return DataLoader(Indices(length), batch_size=batch, shuffle=True, generator=torch.Generator().manual_seed(7))
    sampler = RandomSampler(Indices(length), generator=torch.Generator().manual_seed(8))
    return DataLoader(Indices(length), batch_sampler=BatchSampler(sampler, batch, drop_last=False),
                      generator=torch.Generator().manual_seed(9))


@pytest.mark.parametrize("kind", ["global generator", "loader generator", "sampler and loader generators"])
def test_a_single_process_shuffled_epoch_goes_on_over_two_ranks_in_its_own_order(kind):
    torch.manual_seed(11)
    unbroken = EpochIterator(single_process_loader(kind))
    order = [i for batch in rest_of_epoch(unbroken) for i in batch]

    torch.manual_seed(11)
    stopped = EpochIterator(single_process_loader(kind))
    seen = [i for batch in draw(stopped, 2) for i in batch]
    torch.manual_seed(123)  # the new run's generators are elsewhere: the order must not depend on them
    twos = [EpochIterator(distributed(40, 2, r, 4), epoch=0, resumed=True, position=carried(stopped.position()))
            for r in range(2)]
    per_rank = [rest_of_epoch(iterator) for iterator in twos]
    assert seen == order[:16]
    microsteps = [sorted(per_rank[0][j] + per_rank[1][j]) for j in range(len(per_rank[0]))]
    assert microsteps == [sorted(order[16 + 8 * j : 24 + 8 * j]) for j in range(3)]


def test_a_sampler_trainloop_does_not_know_starts_the_epoch_over_once_with_a_warning():
    def weighted(rank):
        sampler = WeightedRandomSampler([1.0] * 40, 20, generator=torch.Generator().manual_seed(rank))
        return DataLoader(Indices(40), batch_size=4, sampler=sampler)

    iterators = [EpochIterator(weighted(r)) for r in range(2)]
    for iterator in iterators:
        draw(iterator, 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = EpochIterator(weighted(0), resumed=True, position=carried(iterators[0].position()))
    messages = [str(w.message) for w in caught if issubclass(w.category, InexactResumeWarning)]
    assert messages == [
        "resuming mid-epoch inexactly: the data loader's position cannot be carried to other ranks or another batch "
        "size: the checkpoint's sampler is not a DistributedSampler, RandomSampler or SequentialSampler batched by "
        "torch's BatchSampler; epoch 0 starts over from its beginning, so batches the stopped run drew in it are drawn "
        "again"
    ]
    assert resumed.remaining == 5  # the whole epoch


def test_a_dataset_of_another_length_starts_the_epoch_over_with_a_warning():
    iterator = EpochIterator(distributed(40, 2, 0, 4))
    draw(iterator, 2)
    with pytest.warns(InexactResumeWarning, match="the dataset has 48 items and the checkpoint's epoch had 40"):
        resumed = EpochIterator(distributed(48, 3, 0, 4), resumed=True, position=carried(iterator.position()))
    assert resumed.remaining == 4


@pytest.mark.parametrize("workers", [1, 2])
def test_with_persistent_workers_the_dealt_epoch_and_the_next_are_right(workers):
    def loader(ranks, rank, batch):
        return distributed(48, ranks, rank, batch, num_workers=workers, persistent_workers=True)

    first, _, resumed = stop_and_resume([loader(2, r, 6) for r in range(2)], [loader(3, r, 4) for r in range(3)], 2)
    rest = [i for iterator in resumed for batch in rest_of_epoch(iterator) for i in batch]
    assert sorted(rest) == sorted(global_order(48, 1)[24:])
    for r, iterator in enumerate(resumed):
        assert draw(iterator, 4) == [global_order(48, 2)[r::3][j : j + 4] for j in range(0, 16, 4)]
        iterator.close()


def test_with_workers_the_per_rank_replay_skips_what_was_drawn():
    def loader():
        return DataLoader(Indices(40), batch_size=4, shuffle=True, num_workers=2, generator=torch.Generator().manual_seed(3))

    unbroken = EpochIterator(loader())
    expected = draw(unbroken, 10)
    stopped = EpochIterator(loader())
    seen = draw(stopped, 3)
    resumed = EpochIterator(loader(), resumed=True, position=stopped.position())
    assert seen + rest_of_epoch(resumed) == expected
    for iterator in (unbroken, stopped, resumed):
        iterator.close()


def test_two_ranks_go_on_in_one_process_with_a_plain_shuffled_loader():
    stopped = [distributed(48, 2, r, 6) for r in range(2)]
    torch.manual_seed(1)
    single = DataLoader(Indices(48), batch_size=12, shuffle=True)
    first, positions, (resumed,) = stop_and_resume(stopped, [single], 2)
    order = global_order(48, 1)
    assert rest_of_epoch(resumed) == [order[24:36], order[36:48]]  # the rest, in the global order
    assert sorted(i for batch in draw(resumed, 4) for i in batch) == list(range(48))  # then its own epoch
