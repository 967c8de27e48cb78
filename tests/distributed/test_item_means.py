"""``ItemMeans``: the mean over every item of a dataset once, on 2 and 3 gloo ranks as in one process.

A ``DistributedSampler`` pads its list to a multiple of the ranks with its first items; an all-reduce
of sums and counts over what each rank drew counts them twice. The ranks run in one spawn per world
size (each worker plays a torchrun process and runs every case); ``trainloop run`` and ``trainloop
evaluate`` under torchrun are in tests/distributed/test_evaluate_ddp.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from ddp_worker import free_port
from dist_workers import MEANS_CASES, item_means, means_data
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from trainloop.distributed import ItemMeans, ItemMeansError


@pytest.fixture(scope="module", params=[2, 3], ids=["2-ranks", "3-ranks"])
def ranks(request, tmp_path_factory):
    world, out = request.param, tmp_path_factory.mktemp(f"means{request.param}")
    mp.spawn(item_means, args=(world, free_port(), str(out)), nprocs=world, join=True)
    return world, [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


def one_process(items):
    """The means over the whole set, in float64, as one process computes them without ItemMeans."""
    x, tokens = means_data(items).tensors
    sums = (x[:, 1] * tokens).double()  # the per-item sums as the ranks compute them, in float32
    x = x.double()
    return {"first": x[:, 0].mean().item(), "row": x.mean().item(), "tokens": (sums.sum() / tokens.sum()).item()}


@pytest.mark.parametrize("case", MEANS_CASES, ids=[f"{n}-items-batch-{b}{'-shuffled' if s else ''}" for n, b, s in MEANS_CASES])
def test_the_means_over_ranks_are_one_process_means_the_padding_left_out(ranks, case):
    world, results = ranks
    expected = one_process(case[0])
    for rank_result in results:
        found = rank_result[case]["means"]
        assert found == results[0][case]["means"]  # every rank has the same numbers
        assert found == pytest.approx(expected, rel=1e-12, abs=0)
    if case[0] % world:  # the sampler padded: summing what each rank drew counts its first items twice
        assert results[0][case]["naive"] != pytest.approx(expected["first"], rel=1e-3)


def test_data_without_a_distributed_sampler_or_that_leaves_items_out_is_refused_when_built(ranks):
    world, results = ranks
    for rank_result in results:
        assert rank_result["drop_last"] == (
            f"ItemMeans: the data's DistributedSampler has drop_last=True: it leaves out {7 % world} of the 7 items; "
            "build it with drop_last=False (its padding is left out of the means)"
        )
        assert rank_result["unsharded"] == (
            f"ItemMeans under {world} ranks needs a DataLoader with a DistributedSampler (shuffled or not), so that "
            "every item counts once; the data is a DataLoader with a SequentialSampler"
        )


def test_a_rank_that_leaves_items_out_or_adds_other_names_fails_on_every_rank(ranks):
    world, results = ranks
    last = world - 1
    given = -(-7 // world)  # 7 items: 4 each on 2 ranks, 3 each on 3; batches of 2, the last left out
    short = (
        f"ItemMeans: rank {last} added {given - 2 + given % 2} items of 'first', its DistributedSampler gives it "
        f"{given}: add every item the loader gives, once (the padding is left out of the means)"
    )
    for rank_result in results:
        assert rank_result["short"] == short
        assert rank_result["names"] == (
            "ItemMeans: rank 1 added ['first'], rank 0 added ['extra', 'first']: every rank must add the same names"
        )


def test_in_one_process_any_loader_gives_the_whole_set_mean():
    data = means_data(7)
    for loader in (DataLoader(data, batch_size=3), DataLoader(data, batch_size=2, shuffle=True), [data[:4], data[4:]]):
        means = ItemMeans(loader)
        for x, tokens in loader:
            means.add(first=x[:, 0], row=x, positive=x[:, 0] > 0)
            means.add(tokens=(x[:, 1] * tokens, tokens))  # each name counts its own items
        positive = (data.tensors[0][:, 0] > 0).double().mean().item()
        assert means.reduce() == pytest.approx({**one_process(7), "positive": positive}, rel=1e-12, abs=0)
    assert ItemMeans(DataLoader(data)).reduce() == {}
    empty = ItemMeans(DataLoader(data))
    empty.add(tokens=(torch.zeros(2), torch.zeros(2, dtype=torch.long)))
    assert torch.isnan(torch.tensor(empty.reduce()["tokens"]))


def test_a_value_that_is_not_one_per_item_is_one_line_naming_it():
    means = ItemMeans(DataLoader(means_data(7)))
    wrong = {
        "loss": (torch.tensor(1.0), "ItemMeans.add(loss=...): one value per item is needed, a tensor of shape [batch, ...]; got a 0-d tensor (a batch's mean? compute it with reduction='none')"),
        "acc": (0.5, "ItemMeans.add(acc=...): a value is a tensor with one row per item or a pair (sums, counts) of them, not a float"),
        "tokens": ((torch.ones(2), torch.ones(3)), "ItemMeans.add(tokens=(sums, counts)): sums and counts need one entry per item, two [batch] tensors; got shapes [2] and [3]"),
    }  # fmt: skip
    for name, (value, message) in wrong.items():
        with pytest.raises(ItemMeansError) as raised:
            means.add(**{name: value})
        assert str(raised.value) == message


def test_a_loader_that_leaves_items_out_or_is_another_ranks_is_refused_when_built():
    data = TensorDataset(torch.arange(7.0))
    refused = {
        "ItemMeans: the data's DistributedSampler is for rank 1 of 2, this process is rank 0 of 1":
            DataLoader(data, sampler=DistributedSampler(data, num_replicas=2, rank=1)),
        "ItemMeans: the DataLoader has drop_last=True: it leaves out the last 1 of this rank's 7 items; build it "
        "with drop_last=False":
            DataLoader(data, batch_size=2, drop_last=True, sampler=DistributedSampler(data, num_replicas=1, rank=0)),
    }  # fmt: skip
    for message, loader in refused.items():
        with pytest.raises(ItemMeansError) as raised:
            ItemMeans(loader)
        assert str(raised.value) == message
