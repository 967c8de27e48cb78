"""A background save (full or sharded) copies parameters and optimizer state off the training
thread; the next optimizer step waits for that copy; nothing is held once the save is published."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future

import pytest
import torch
from torch import nn

from trainloop.checkpoint.files import read_checkpoint
from trainloop.checkpoint.manager import CheckpointManager
from trainloop.checkpoint.staging import CpuStage, ReusingStager, stepped_by


def test_a_deferred_tensor_is_copied_by_finish_copy():
    kept, deferred = torch.ones(3), torch.full((3,), 2.0)
    stage = CpuStage()
    copied = stage.copy({"kept": kept, "deferred": deferred}, defer=lambda t: t is deferred)
    kept.add_(10)  # after the copy: not seen
    stage.finish_copy()
    assert torch.equal(copied["kept"], torch.ones(3))
    assert torch.equal(copied["deferred"], torch.full((3,), 2.0))
    stage.release()
    assert stage._buffers == {}


def test_a_deferred_tensor_changed_in_place_before_its_copy_fails_loudly():
    deferred = torch.zeros(3)
    stage = CpuStage()
    stage.copy({"deferred": deferred}, defer=lambda t: True)
    deferred.add_(1)
    with pytest.raises(RuntimeError, match="changed in place after the save began"):
        stage.finish_copy()


def test_the_sharded_stager_copies_parameters_on_a_thread_of_its_own():
    param, buffer = nn.Parameter(torch.ones(3)), torch.full((3,), 5.0)
    optimizer = torch.optim.SGD([param], lr=0.1)
    copied = threading.Event()
    stager = ReusingStager(CpuStage(), stepped_by([optimizer]), copied)
    staged = stager.stage({"param": param, "buffer": buffer})
    assert isinstance(staged, Future)  # DCP's writer waits for it; the loop does not
    result = staged.result(timeout=30)
    assert copied.is_set()
    assert torch.equal(result["param"], torch.ones(3))
    assert torch.equal(result["buffer"], torch.full((3,), 5.0))
    assert result["param"].data_ptr() != param.data_ptr()  # a copy, not the live tensor


@pytest.mark.parametrize("format", ["full", "sharded"])
def test_the_next_optimizer_step_waits_for_the_background_copy(tmp_path, format):
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.randn(4, 64)).sum().backward()
        optimizer.step()
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    manager = CheckpointManager(tmp_path, format, async_save=True, logger=logging.getLogger("test"))
    state = {"model": model_state, "training_state": {"step": 2, "epoch": 0, "optimizer": optimizer_state}}
    assert manager.save(2, state, [optimizer]) is None
    model(torch.randn(4, 64)).sum().backward()
    optimizer.step()  # changes every parameter: only once the background copy is done
    assert manager.settle(agree=False) is None
    saved = read_checkpoint(tmp_path / "2")["model"]
    assert all(torch.equal(saved[k], before[k]) for k in before)  # the state when the save began
    assert not all(torch.equal(model.state_dict()[k], before[k]) for k in before)
    assert manager._stage._buffers == {}  # nothing held once published
    assert manager.close() is None
