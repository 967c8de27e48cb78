"""trainloop.checkpoint.saver in one process: foreground and background saves in both formats,
what they publish, and how failures are reported."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from trainloop.checkpoint import (
    LATEST,
    CheckpointError,
    CheckpointSaveError,
    checkpoint_format,
    checkpoint_steps,
    read_checkpoint,
    verify_checkpoint,
)
from trainloop.checkpoint.manifest import make_metadata
from trainloop.checkpoint.saver import CheckpointSaver, agree_on_error, as_save_failure, broadcast_from_rank_zero

LOGGER = logging.getLogger("test_saver")
FORMATS = ["full", "sharded"]


def state(value: float) -> dict:
    return {
        "model": {"w": torch.full((8,), value)},
        "training_state": {"step": 1, "epoch": 0, "optimizer": {"state": {}, "param_groups": []}},
    }


def save(saver: CheckpointSaver, root: Path, step: int, value: float, published: list) -> BaseException | None:
    return saver.save(root, step, state(value), make_metadata(step, 0, saver.format), published.append)


@pytest.mark.parametrize("format", FORMATS)
def test_a_foreground_save_publishes_and_points_latest(tmp_path, format, caplog):
    published: list[Path] = []
    saver = CheckpointSaver(format, async_save=False, logger=LOGGER)
    with caplog.at_level(logging.INFO, logger="test_saver"):
        assert save(saver, tmp_path, 3, 1.5, published) is None
    assert published == [tmp_path / "3"]
    assert os.readlink(tmp_path / LATEST) == "3"
    assert checkpoint_format(tmp_path / "3") == format
    verify_checkpoint(tmp_path / "3")
    assert torch.equal(read_checkpoint(tmp_path / "3")["model"]["w"], torch.full((8,), 1.5))
    assert f"Saved checkpoint {tmp_path / '3'}" in caplog.text


@pytest.mark.parametrize("format", FORMATS)
def test_a_background_save_writes_the_state_as_it_was_and_publishes_once_settled(tmp_path, format):
    published: list[Path] = []
    saver = CheckpointSaver(format, async_save=True, logger=LOGGER)
    live = state(1.0)
    assert saver.save(tmp_path, 1, live, make_metadata(1, 0, format), published.append) is None
    live["model"]["w"].add_(100.0)  # training goes on while the write runs
    with pytest.raises(RuntimeError, match="still being written"):
        save(saver, tmp_path, 2, 2.0, published)
    assert saver.settle(agree=True) is None
    assert published == [tmp_path / "1"]
    assert torch.equal(read_checkpoint(tmp_path / "1")["model"]["w"], torch.full((8,), 1.0))
    assert saver.settle(agree=False) is None  # nothing in flight
    saver.close()


@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("async_save", [False, True])
def test_an_unwritable_directory_is_a_save_error_naming_the_checkpoint(tmp_path, format, async_save):
    if os.geteuid() == 0:
        # root writes anywhere: a file where the directory should be refuses everyone.
        (tmp_path / "root").write_text("not a directory")
    else:
        (tmp_path / "root").mkdir(mode=0o500)
    saver = CheckpointSaver(format, async_save=async_save, logger=LOGGER)
    published: list[Path] = []
    error = save(saver, tmp_path / "root", 5, 1.0, published)
    if async_save and error is None:
        error = saver.settle(agree=False)
    assert isinstance(error, CheckpointSaveError)
    assert str(error).startswith(f"could not save checkpoint {tmp_path / 'root' / '5'}")
    assert published == []


@pytest.mark.parametrize("async_save", [False, True])
def test_a_state_that_cannot_be_written_is_a_checkpoint_error_not_a_save_error(tmp_path, async_save):
    saver = CheckpointSaver("full", async_save=async_save, logger=LOGGER)
    bad = state(1.0)
    bad["training_state"]["fn"] = lambda: None
    error = saver.save(tmp_path, 1, bad, make_metadata(1, 0, "full"), lambda _: None)
    if async_save and error is None:
        error = saver.settle(agree=False)
    assert type(error) is CheckpointError
    assert "could not save checkpoint" in str(error)
    assert checkpoint_steps(tmp_path) == []
    assert sorted(os.listdir(tmp_path)) == []


def test_as_save_failure_finds_the_operating_system_error_in_the_chain(tmp_path):
    try:
        try:
            raise OSError(28, "No space left on device")
        except OSError as disk:
            raise RuntimeError("PytorchStreamWriter failed writing file") from disk
    except RuntimeError as error:
        failure = as_save_failure(tmp_path / "4", error)
    assert isinstance(failure, CheckpointSaveError)
    assert "No space left on device" in str(failure)
    other = as_save_failure(tmp_path / "4", TypeError("cannot pickle"))
    assert type(other) is CheckpointError
    assert "TypeError: cannot pickle" in str(other)


def test_without_a_process_group_agreement_and_broadcast_are_this_process_own():
    error = ValueError("x")
    assert agree_on_error(error) is error
    assert agree_on_error(None) is None
    assert broadcast_from_rank_zero({"a": 1}) == {"a": 1}
