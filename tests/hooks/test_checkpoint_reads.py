"""A resume reads each checkpoint file once: verified as it is loaded, not in a pass of its own;
and an AdamW state comes back exactly without torch's dummy optimizer step."""

from __future__ import annotations

import builtins
import io
import os
from collections import Counter
from pathlib import Path

import pytest
import torch
from tiny_trainer import TinyTrainer
from torch.optim.optimizer import register_optimizer_step_pre_hook

from trainloop.hooks.checkpointing import CheckpointingHook


class AdamTrainer(TinyTrainer):
    def build_optimizer(self):
        return torch.optim.AdamW(self.model.parameters(), lr=self.lr)


def reads_during(fn, directory: Path) -> Counter[str]:
    """How often each file under ``directory`` is opened (Python's ``open``, ``os.open``, or
    ``torch.load`` given a path) while ``fn`` runs."""
    opened: Counter[str] = Counter()
    originals = builtins.open, os.open, torch.load, io.open

    def note(path) -> None:
        if isinstance(path, (str, os.PathLike)):
            resolved = Path(path).resolve()
            if resolved.is_relative_to(directory.resolve()) and resolved.is_file():
                opened[str(resolved.relative_to(directory.resolve()))] += 1

    def counting_open(file, *args, **kwargs):
        note(file)
        return originals[0](file, *args, **kwargs)

    def counting_os_open(path, *args, **kwargs):
        note(path)
        return originals[1](path, *args, **kwargs)

    def counting_load(f, *args, **kwargs):
        note(f)
        return originals[2](f, *args, **kwargs)

    builtins.open, os.open, torch.load, io.open = counting_open, counting_os_open, counting_load, counting_open
    try:
        fn()
    finally:
        builtins.open, os.open, torch.load, io.open = originals
    return opened


@pytest.mark.parametrize("format", ["full", "sharded"])
def test_a_resumed_run_reads_every_checkpoint_file_once(tmp_path, format):
    torch.manual_seed(0)
    AdamTrainer(max_steps=4, workspace=tmp_path, hooks=[CheckpointingHook(interval=4, format=format)]).train()
    checkpoint = tmp_path / "checkpoints" / "4"
    files = sorted(str(p.relative_to(checkpoint)) for p in checkpoint.rglob("*") if p.is_file())
    if format == "sharded":
        assert any(name.startswith("sharded/") and name.endswith(".distcp") for name in files), files
    resumed = AdamTrainer(max_steps=4, workspace=tmp_path, hooks=[CheckpointingHook(interval=4, format=format)])
    opened = reads_during(resumed.train, checkpoint)
    assert resumed.step == 4  # it resumed (max_steps reached: nothing more to train)
    assert sorted(opened) == files, opened  # every file was read (so verified)...
    assert set(opened.values()) == {1}, opened  # ...once


@pytest.mark.parametrize("optimizer", ["adamw", "sgd-momentum"])
def test_the_optimizer_state_loads_exactly_without_a_dummy_step(tmp_path, optimizer):
    class Trainer(TinyTrainer):
        def build_optimizer(self):
            if optimizer == "adamw":
                return torch.optim.AdamW(self.model.parameters(), lr=self.lr)
            return torch.optim.SGD(self.model.parameters(), lr=self.lr, momentum=0.9)

    torch.manual_seed(0)
    first = Trainer(max_steps=3, workspace=tmp_path, hooks=[CheckpointingHook(interval=3)])
    first.train()
    resumed = Trainer(max_steps=3, workspace=tmp_path, hooks=[CheckpointingHook(interval=3)])
    steps: list[str] = []
    handle = register_optimizer_step_pre_hook(lambda opt, args, kwargs: steps.append("step"))
    try:
        resumed.train()  # resumes at step 3 = max_steps: no step to train
    finally:
        handle.remove()
    assert resumed.step == 3
    assert steps == []  # torch's set_state_dict would have stepped once
    saved, loaded = first.optimizer.state_dict(), resumed.optimizer.state_dict()
    assert saved["param_groups"] == loaded["param_groups"]
    assert saved["state"].keys() == loaded["state"].keys()
    for key, state in saved["state"].items():
        for name, value in state.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(loaded["state"][key][name])), (key, name)
