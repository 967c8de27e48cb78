"""Exact resume with a plain ``torch.utils.data.DataLoader`` (shuffling, no state of its own):
a run stopped mid-epoch by a real SIGTERM, or killed by SIGKILL after a mid-epoch checkpoint,
resumes in a new process bitwise identical to the unbroken run (``resume_child.py`` with
``"loader": "plain"``). A loader that cannot be positioned says so on resume."""

from __future__ import annotations

import json
import signal
import warnings
from pathlib import Path

import pytest
import torch
from child_process import ChildProcess
from tiny_trainer import TinyTrainer, make_data
from torch.utils.data import DataLoader

from trainloop.checkpoint import read_checkpoint
from trainloop.core.data import InexactResumeWarning
from trainloop.hooks.checkpointing import CheckpointingHook

CHILD = Path(__file__).resolve().parents[1] / "support" / "resume_child.py"
TIMEOUT = 240
MAX_STEPS = 17
# 5 batches per epoch: a SIGTERM as step 7 begins (batch 2 of epoch 1); with accumulation 3, a
# SIGKILL after the save of step 4 (12 batches: batch 2 of epoch 2); validating every 3 steps, a
# SIGTERM as step 6 begins (batch 1 of epoch 1), where a validation is due and is skipped for the save.
SCENARIOS = {("sigterm", 1): 7, ("sigkill", 3): 4, ("sigterm-validating", 1): 6}
VALIDATE = {("sigterm-validating", 1): 3}


def reference(accumulation: int, validate: int | None = None) -> list[torch.Tensor]:
    from resume_child import trainer_for

    run = {"workspace": None, "max_steps": MAX_STEPS, "accumulation": accumulation, "loader": "plain", "validate": validate}
    trainer = trainer_for(run, [])
    trainer.train()
    return [p.detach().clone() for p in trainer.model.parameters()]


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("plain")
    children, runs = {}, {}
    for (how, acc), at in SCENARIOS.items():
        run = {"workspace": str(tmp / f"{how}{acc}"), "max_steps": MAX_STEPS, "accumulation": acc, "loader": "plain",
               "validate": VALIDATE.get((how, acc))}
        signalled = how.startswith("sigterm")
        pause = {"pause_before_step": at, "interval": 1000} if signalled else {"pause_after_save": at, "interval": at}
        runs[how, acc] = run
        children[how, acc] = ChildProcess(CHILD, [json.dumps([{**run, **pause}])], tmp)
    found = {}
    try:
        for (how, acc), child in children.items():
            child.wait_for(f"0 paused {SCENARIOS[how, acc]}", timeout=TIMEOUT, exact=True)
            child.proc.send_signal(signal.SIGTERM if how.startswith("sigterm") else signal.SIGKILL)
            if how.startswith("sigterm"):
                child.send("")
            code = child.finish(timeout=TIMEOUT)
            saved = read_checkpoint(Path(runs[how, acc]["workspace"]) / "checkpoints" / str(SCENARIOS[how, acc]))
            found[how, acc] = {"code": code, "position": saved["training_state"]["data_loader"][0]}
        outs = {key: str(tmp / f"{key[0]}{key[1]}.out") for key in runs}
        resumer = ChildProcess(CHILD, [json.dumps([{**runs[key], "interval": 1000, "out": outs[key]} for key in runs])], tmp)
        assert resumer.finish(timeout=TIMEOUT) == 0, resumer.stderr()
        for key in runs:
            found[key]["resumed"] = torch.load(f"{outs[key]}.rank0", weights_only=True)
    finally:
        for child in children.values():
            if child.proc.poll() is None:
                child.proc.kill()
                child.proc.wait()
    return found


@pytest.mark.parametrize(("how", "accumulation"), list(SCENARIOS), ids=[f"{h}-accumulation{a}" for h, a in SCENARIOS])
def test_a_plain_dataloader_run_stopped_mid_epoch_resumes_bitwise(resumed, how, accumulation):
    result = resumed[how, accumulation]
    assert result["code"] == (143 if how.startswith("sigterm") else -signal.SIGKILL)
    drawn = SCENARIOS[how, accumulation] * accumulation % 5
    assert result["position"]["trainloop_sampler_position"]["drawn"] == drawn  # mid-epoch, as meant
    assert result["resumed"]["started"] == SCENARIOS[how, accumulation]
    assert result["resumed"]["step"] == MAX_STEPS
    expected = reference(accumulation, VALIDATE.get((how, accumulation)))
    for got, want in zip(result["resumed"]["params"], expected, strict=True):
        assert torch.equal(got, want), (got - want).abs().max()


def test_batches_already_drawn_are_skipped_without_loading_their_data(tmp_path):
    loaded: list[int] = []

    class Counting(torch.utils.data.Dataset):
        def __len__(self):
            return 40

        def __getitem__(self, i):
            loaded.append(i)
            return make_data(40)[i]

    def loader():
        return DataLoader(Counting(), batch_size=8, shuffle=True)

    TinyTrainer(max_steps=3, seed=1, data=loader(), workspace=tmp_path, hooks=[CheckpointingHook(interval=3)]).train()
    loaded.clear()
    TinyTrainer(max_steps=4, seed=1, data=loader(), workspace=tmp_path, hooks=[CheckpointingHook(interval=100)]).train()
    assert len(loaded) == 8  # the one batch of step 4, not the three before it


def test_a_loader_with_neither_sampler_nor_state_says_once_what_will_differ(tmp_path):
    batches = [make_data(40)[i : i + 8] for i in range(0, 40, 8)]
    TinyTrainer(max_steps=3, data=batches, workspace=tmp_path, hooks=[CheckpointingHook(interval=3)]).train()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        TinyTrainer(max_steps=6, data=batches, workspace=tmp_path, hooks=[CheckpointingHook(interval=100)]).train()
    inexact = [str(w.message) for w in caught if issubclass(w.category, InexactResumeWarning)]
    assert inexact == [
        "resuming with a data loader (list, from build_data_loader()) that has neither a sampler nor a saved state: "
        "epoch 0 starts over from its beginning, so batches the stopped run drew in it are drawn again and the order "
        "may differ from an unbroken run; use a DataLoader over a map-style dataset or a StatefulDataLoader for an exact resume"
    ]
