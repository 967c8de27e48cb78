"""trainloop.checkpoint.staging: the copy a background save writes is a snapshot, and its CPU
buffers are reused from one save to the next."""

from __future__ import annotations

from collections import OrderedDict, namedtuple

import pytest
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


# -- what is kept between saves -------------------------------------------------------------------


def test_between_saves_no_pageable_copy_is_kept_and_nothing_is_left_to_finish():
    stage = CpuStage()
    first = stage.copy(state(1.0))
    assert not stage.pending  # copied from the CPU at once: nothing for finish_copy
    stage.release()  # the save is written
    second = stage.copy(state(2.0))
    # CPU (pageable) buffers were let go: allocated anew, as before pinned buffers existed.
    assert all(a is not b for a, b in zip(first["model"].values(), second["model"].values(), strict=True))
    assert ptrs(second) != ptrs(first)


def test_stage_to_cpu_finishes_its_copy():
    copied = stage_to_cpu(state(4.0))
    assert torch.equal(copied["model"]["w"], torch.full((4, 3), 4.0))


# -- from CUDA: pinned buffers, kept across saves, copied on a side stream -------------------------


def cuda_state(scale: float, size: int = 1 << 20) -> dict:
    return {"model": {"w": torch.full((size,), scale, device="cuda"), "n": torch.tensor(scale, device="cuda")},
            "step": 3}


@pytest.mark.cuda
def test_cuda_tensors_are_staged_into_pinned_buffers_kept_across_saves():
    stage = CpuStage()
    first = stage.copy(cuda_state(1.0))
    stage.finish_copy()
    assert first["model"]["w"].is_pinned()
    assert first["model"]["w"].device.type == "cpu"
    assert torch.equal(first["model"]["w"], torch.full((1 << 20,), 1.0))
    pointer = first["model"]["w"].data_ptr()
    stage.release()  # the save is written: the pinned buffers stay for the next one
    second = stage.copy(cuda_state(2.0))
    stage.finish_copy()
    assert second["model"]["w"].data_ptr() == pointer  # allocated once, reused
    assert torch.equal(second["model"]["w"], torch.full((1 << 20,), 2.0))
    assert second["model"]["n"].item() == 2.0
    assert second["step"] == 3


@pytest.mark.cuda
def test_the_cuda_copy_is_the_state_when_the_save_began_though_training_goes_on():
    stage = CpuStage()
    live = cuda_state(1.0, size=1 << 24)
    stage.copy(live)  # warm: buffers allocated
    stage.finish_copy()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # queuing the copy never waits for the device
    try:
        copied = stage.copy(live)
        live["model"]["w"].add_(1.0)  # training changes the state right after: on its own stream
    finally:
        torch.cuda.set_sync_debug_mode("default")
    stage.finish_copy()
    assert torch.equal(copied["model"]["w"], torch.full((1 << 24,), 1.0))
    assert torch.equal(live["model"]["w"].cpu(), torch.full((1 << 24,), 2.0))


@pytest.mark.cuda
def test_a_deferred_cuda_tensor_changed_before_its_copy_is_done_fails_loudly():
    stage = CpuStage()
    live = cuda_state(1.0, size=1 << 24)
    stage.copy(live, defer=lambda t: t.numel() > 1)
    live["model"]["w"].mul_(3.0)  # not the optimizer's step: the copy may have read either value
    with pytest.raises(RuntimeError, match="changed in place after the save began"):
        stage.finish_copy()


@pytest.mark.cuda
def test_the_loop_waits_for_a_cuda_save_at_most_twice_the_pinned_copy():
    """Issue 27: blocked at most 2x the device-to-pinned copy of the same bytes (~256 MiB here)."""
    import time

    stage = CpuStage()
    live = cuda_state(1.0, size=64 << 20)
    pinned = torch.empty(64 << 20, pin_memory=True)
    stage.copy(live)  # the first save allocates and pins: paid once
    stage.finish_copy()
    copies, blocked = [], []
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        pinned.copy_(live["model"]["w"], non_blocking=True)
        torch.cuda.synchronize()
        copies.append(time.perf_counter() - start)
        start = time.perf_counter()
        stage.copy(live)
        blocked.append(time.perf_counter() - start)
        stage.finish_copy()
    assert min(blocked) <= 2 * min(copies), (blocked, copies)


@pytest.mark.cuda
@pytest.mark.parametrize("format", ["full", "sharded"])
def test_an_async_save_of_a_cuda_run_writes_each_saved_steps_state(tmp_path, format):
    from tiny_trainer import TinyTrainer

    from trainloop.checkpoint import read_checkpoint
    from trainloop.hooks.checkpointing import CheckpointingHook

    class Keep(TinyTrainer):
        saved: dict = {}

        def build_hooks(self):
            class Snapshot(CheckpointingHook):
                def on_schedule(self, trainer):
                    Keep.saved[trainer.step] = {k: v.detach().cpu().clone() for k, v in trainer.model.state_dict().items()}
                    super().on_schedule(trainer)

            return [Snapshot(interval=2, keep_previous=3, format=format, async_save=True)]

    Keep(max_steps=6, device="cuda", workspace=tmp_path).train()
    for step in (2, 4, 6):
        model = read_checkpoint(tmp_path / "checkpoints" / str(step))["model"]
        for name, value in Keep.saved[step].items():
            assert torch.equal(model[name], value), (step, name)
