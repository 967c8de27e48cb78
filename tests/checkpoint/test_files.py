"""trainloop.checkpoint.files: write_checkpoint publishes a checkpoint and ``latest`` together, or
neither."""

from __future__ import annotations

import os

import pytest
import torch

from trainloop.checkpoint import (
    LATEST,
    CheckpointSaveError,
    checkpoint_steps,
    latest_checkpoint,
    read_checkpoint,
    write_checkpoint,
)


def state(value: float) -> dict:
    return {"model": {"w": torch.full((3,), value)}, "training_state": {"step": 3, "epoch": 0}}


def test_write_checkpoint_points_latest_at_it(tmp_path):
    write_checkpoint(tmp_path, 2, state(2.0))
    target = write_checkpoint(tmp_path, 3, state(3.0))
    assert target == tmp_path / "3"
    assert os.readlink(tmp_path / LATEST) == "3"
    assert latest_checkpoint(tmp_path) == target
    assert torch.equal(read_checkpoint(target)["model"]["w"], torch.full((3,), 3.0))


def make_latest_unreplaceable(root) -> None:
    """A real directory named ``latest`` (not a symlink): renaming the new link onto it fails."""
    if (root / LATEST).is_symlink():
        (root / LATEST).unlink()
    (root / LATEST).mkdir(parents=True)
    (root / LATEST / "keep").write_text("a user's file")


def test_a_failed_latest_update_leaves_no_step_directory(tmp_path):
    make_latest_unreplaceable(tmp_path)
    with pytest.raises(CheckpointSaveError, match=rf"could not save checkpoint {tmp_path / '3'}: .*latest"):
        write_checkpoint(tmp_path, 3, state(3.0))
    assert checkpoint_steps(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST]  # nothing hidden left either
    assert latest_checkpoint(tmp_path) is None


def test_a_failed_latest_update_while_resaving_a_step_puts_the_old_one_back(tmp_path):
    write_checkpoint(tmp_path, 3, state(1.0))
    make_latest_unreplaceable(tmp_path)
    with pytest.raises(CheckpointSaveError):
        write_checkpoint(tmp_path, 3, state(2.0))
    assert checkpoint_steps(tmp_path) == [3]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["3", LATEST]
    assert torch.equal(read_checkpoint(tmp_path / "3")["model"]["w"], torch.full((3,), 1.0))
