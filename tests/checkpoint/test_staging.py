"""trainloop.checkpoint.staging: the copy a background save writes is a snapshot, and its CPU
buffers are reused from one save to the next."""

from __future__ import annotations

from collections import OrderedDict, namedtuple

import torch

from trainloop.checkpoint.staging import CpuStage, ReusingStager, stage_to_cpu

Pair = namedtuple("Pair", "a b")


def state(scale: float) -> dict:
    return {
        "model": OrderedDict(w=torch.full((4, 3), scale), b=torch.arange(3.0) * scale),
        "training_state": {"step": 7, "pair": Pair(torch.tensor(scale), [1, 2]), "tags": {"x"}},
    }


def ptrs(copied: dict) -> list[int]:
    return [copied["model"]["w"].data_ptr(), copied["model"]["b"].data_ptr(), copied["training_state"]["pair"].a.data_ptr()]


def test_a_second_copy_reuses_the_first_ones_buffers_and_holds_the_new_values():
    stage = CpuStage()
    first = stage.copy(state(1.0))
    first_ptrs = ptrs(first)
    second = stage.copy(state(2.0))
    assert ptrs(second) == first_ptrs  # the same memory, no new allocation
    assert torch.equal(second["model"]["w"], torch.full((4, 3), 2.0))
    assert torch.equal(second["training_state"]["pair"].a, torch.tensor(2.0))


def test_a_tensor_whose_shape_or_dtype_changed_gets_a_new_buffer_and_gone_ones_are_released():
    stage = CpuStage()
    first = stage.copy(state(1.0))
    changed = state(1.0)
    changed["model"]["w"] = torch.zeros(5, 3)  # another shape
    changed["model"]["b"] = changed["model"]["b"].double()  # another dtype
    del changed["training_state"]["pair"]
    second = stage.copy(changed)
    assert second["model"]["w"].data_ptr() != first["model"]["w"].data_ptr()
    assert second["model"]["b"].dtype == torch.float64
    assert len(stage._buffers) == 2  # the buffer of the tensor gone from the state is let go


def test_the_copy_is_a_snapshot_that_training_cannot_change():
    live = state(1.0)
    copied = CpuStage().copy(live)
    live["model"]["w"].add_(5.0)  # training goes on in place
    live["training_state"]["tags"].add("y")
    assert torch.equal(copied["model"]["w"], torch.full((4, 3), 1.0))
    assert copied["training_state"]["tags"] == {"x"}
    assert copied["model"]["w"].data_ptr() != live["model"]["w"].data_ptr()


def test_containers_keep_their_types():
    copied = stage_to_cpu(state(3.0))
    assert type(copied["model"]) is OrderedDict
    assert list(copied["model"]) == ["w", "b"]
    pair = copied["training_state"]["pair"]
    assert type(pair) is Pair
    assert pair.b == [1, 2]
    assert copied["training_state"]["step"] == 7


def test_stage_to_cpu_allocates_anew_each_time():
    assert ptrs(stage_to_cpu(state(1.0))) != ptrs(stage_to_cpu(state(1.0)))


def test_the_reusing_stager_stages_through_its_cpu_stage():
    stage = CpuStage()
    stager = ReusingStager(stage)
    first = stager.stage(state(1.0))
    second = stager.stage(state(2.0))
    assert ptrs(first) == ptrs(second)
    assert ReusingStager.suits(state(1.0))
