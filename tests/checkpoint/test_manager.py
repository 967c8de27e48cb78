"""trainloop.checkpoint.manager in one process: foreground and background saves in both formats,
what they publish and in which order, what pruning removes, and how failures are reported."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from trainloop.checkpoint import (
    LATEST,
    CheckpointError,
    CheckpointSaveError,
    checkpoint_format,
    checkpoint_steps,
    read_checkpoint,
    storage,
    verify_checkpoint,
)
from trainloop.checkpoint.best import BEST_FILE, BestCheckpoints
from trainloop.checkpoint.manager import CheckpointManager, as_save_failure, latest_checkpoint, latest_step
from trainloop.distributed.ranks import agree_on_error, broadcast_from_rank_zero

LOGGER = logging.getLogger("test_manager")
FORMATS = ["full", "sharded"]


def state(value: float) -> dict:
    return {
        "model": {"w": torch.full((8,), value)},
        "training_state": {"step": 1, "epoch": 0, "optimizer": {"state": {}, "param_groups": []}},
    }


def save(manager: CheckpointManager, step: int, value: float) -> BaseException | None:
    return manager.save(step, state(value))


@pytest.mark.parametrize("format", FORMATS)
def test_a_foreground_save_publishes_and_points_latest(tmp_path, format, caplog):
    manager = CheckpointManager(tmp_path, format, async_save=False, logger=LOGGER)
    with caplog.at_level(logging.INFO, logger="test_manager"):
        assert save(manager, 3, 1.5) is None
    assert checkpoint_steps(tmp_path) == [3]
    assert os.readlink(tmp_path / LATEST) == "3"
    assert checkpoint_format(tmp_path / "3") == format
    verify_checkpoint(tmp_path / "3")
    assert torch.equal(read_checkpoint(tmp_path / "3")["model"]["w"], torch.full((8,), 1.5))
    assert f"Saved checkpoint {tmp_path / '3'}" in caplog.text


@pytest.mark.parametrize("format", FORMATS)
def test_a_background_save_writes_the_state_as_it_was_and_publishes_once_settled(tmp_path, format):
    manager = CheckpointManager(tmp_path, format, async_save=True, logger=LOGGER)
    live = state(1.0)
    assert manager.save(1, live) is None
    live["model"]["w"].add_(100.0)  # training goes on while the write runs
    with pytest.raises(RuntimeError, match="still being written"):
        save(manager, 2, 2.0)
    assert manager.settle(agree=True) is None
    assert latest_step(tmp_path) == 1
    assert torch.equal(read_checkpoint(tmp_path / "1")["model"]["w"], torch.full((8,), 1.0))
    assert manager.settle(agree=False) is None  # nothing in flight
    assert manager.close() is None


@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("async_save", [False, True])
def test_an_unwritable_directory_is_a_save_error_naming_the_checkpoint(tmp_path, format, async_save):
    if os.geteuid() == 0:
        # root writes anywhere: a file where the directory should be refuses everyone.
        (tmp_path / "root").write_text("not a directory")
    else:
        (tmp_path / "root").mkdir(mode=0o500)
    manager = CheckpointManager(tmp_path / "root", format, async_save=async_save, logger=LOGGER)
    error = save(manager, 5, 1.0)
    if async_save and error is None:
        error = manager.settle(agree=False)
    assert isinstance(error, CheckpointSaveError)
    assert str(error).startswith(f"could not save checkpoint {tmp_path / 'root' / '5'}")
    assert latest_step(tmp_path / "root") is None


@pytest.mark.parametrize("async_save", [False, True])
def test_a_state_that_cannot_be_written_is_a_checkpoint_error_not_a_save_error(tmp_path, async_save):
    manager = CheckpointManager(tmp_path, "full", async_save=async_save, logger=LOGGER)
    bad = state(1.0)
    bad["training_state"]["fn"] = lambda: None
    error = manager.save(1, bad)
    if async_save and error is None:
        error = manager.settle(agree=False)
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


def test_metadata_holds_the_state_step_epoch_and_the_last_logged_metrics(tmp_path):
    manager = CheckpointManager(tmp_path, logger=LOGGER)
    assert manager.log(1, {"train/loss": torch.tensor(0.5)}) is None
    assert manager.save(1, state(1.0)) is None
    from trainloop.checkpoint import read_metadata

    metadata = read_metadata(tmp_path / "1")
    assert (metadata["step"], metadata["epoch"], metadata["format"]) == (1, 0, "full")
    assert metadata["metrics"] == {"train/loss": 0.5}


def test_pruning_removes_only_step_names_and_keeps_latest_and_the_kept(tmp_path):
    manager = CheckpointManager(tmp_path, logger=LOGGER, keep_previous=1, keep_interval=4, keep_steps=frozenset({1}))
    for step in range(1, 8):
        assert manager.save(step, state(float(step))) is None
    (tmp_path / "notes").mkdir()  # not a step's name: never pruned
    (tmp_path / "0009").mkdir()  # written by hand: a save never names a step so
    (tmp_path / "README").write_text("mine")
    assert manager.save(8, state(8.0)) is None
    assert manager.close() is None  # the background removals are done
    # 8 the newest, 7 the one before, 4 and 8 by keep_interval, 1 by keep_steps.
    assert checkpoint_steps(tmp_path) == [1, 4, 7, 8]
    assert sorted(os.listdir(tmp_path)) == ["0009", "1", "4", "7", "8", "README", "latest", "notes"]
    assert os.readlink(tmp_path / LATEST) == "8"


def test_the_best_are_kept_from_pruning_and_listed_in_best_json(tmp_path):
    best = BestCheckpoints("val/loss", "min", keep=1)
    manager = CheckpointManager(tmp_path, logger=LOGGER, keep_previous=0, best=best)
    for step, loss in ((1, 0.5), (2, 0.1), (3, 0.3)):
        manager.log(step, {"val/loss": loss})
        assert manager.save(step, state(float(step))) is None
    assert manager.close() is None
    assert checkpoint_steps(tmp_path) == [2, 3]
    assert manager.best_checkpoint == tmp_path / "2"
    assert '"best": 2' in (tmp_path / BEST_FILE).read_text()


def test_a_score_logged_after_the_save_scores_that_checkpoint(tmp_path):
    manager = CheckpointManager(tmp_path, logger=LOGGER, keep_previous=0, best=BestCheckpoints("val/loss", "min", 1))
    manager.log(1, {"val/loss": 0.1})
    assert manager.save(1, state(1.0)) is None
    assert manager.save(2, state(2.0)) is None
    assert manager.log(2, {"val/loss": 0.9}) is None  # an evaluation at the end: step 2 is scored now
    assert manager.close() is None
    assert checkpoint_steps(tmp_path) == [1, 2]
    assert manager.best_checkpoint == tmp_path / "1"


@pytest.mark.parametrize("format", FORMATS)
def test_a_crash_between_the_manifest_and_the_rename_leaves_the_previous_latest_valid(tmp_path, format, monkeypatch):
    manager = CheckpointManager(tmp_path, format, logger=LOGGER, keep_previous=0)
    assert save(manager, 1, 1.0) is None

    def crash(tmp, target):
        assert (tmp / "manifest.json").is_file()  # the manifest is written before the rename
        raise KeyboardInterrupt  # the process dies here: nothing of ours runs after it

    monkeypatch.setattr(storage, "publish", crash)
    monkeypatch.setattr(storage, "discard", lambda tmp: None)  # a crash cleans nothing up
    with pytest.raises(KeyboardInterrupt):
        save(manager, 2, 2.0)
    monkeypatch.undo()
    assert checkpoint_steps(tmp_path) == [1]
    assert latest_step(tmp_path) == 1
    assert latest_checkpoint(tmp_path) == tmp_path / "1"  # verified against its manifest
    assert any(name.startswith(".2.tmp-") for name in os.listdir(tmp_path))  # the unpublished one, hidden
    chosen = CheckpointManager(tmp_path, format, logger=LOGGER).choose("latest")  # cleans up, then loads 1
    assert chosen is not None
    assert chosen[0] == tmp_path / "1"
    if not isinstance(chosen[1], dict):
        chosen[1].close()
    assert sorted(os.listdir(tmp_path)) == ["1", "latest"]


def test_latest_that_cannot_be_pointed_undoes_the_publication(tmp_path, monkeypatch):
    manager = CheckpointManager(tmp_path, logger=LOGGER, keep_previous=0)
    assert save(manager, 1, 1.0) is None

    def full_disk(link, target):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(storage, "replace_symlink", full_disk)
    error = save(manager, 1, 5.0)  # the same step saved again: the old one comes back
    assert isinstance(error, CheckpointSaveError)
    assert "No space left on device" in str(error)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["1", "latest"]
    assert torch.equal(read_checkpoint(tmp_path / "1")["model"]["w"], torch.full((8,), 1.0))


def test_load_falls_back_from_a_corrupt_newest_checkpoint(tmp_path, caplog):
    manager = CheckpointManager(tmp_path, logger=LOGGER, keep_previous=5)
    assert save(manager, 1, 1.0) is None
    assert save(manager, 2, 2.0) is None
    (tmp_path / "2" / "model.pt").write_bytes(b"corrupt")

    class Target:
        state_dict_options = None
        loaded: dict | None = None

        def state_dict(self):
            return {}

        def load_state_dict(self, state_dict):
            self.loaded = state_dict

    target = Target()
    with caplog.at_level(logging.WARNING, logger="test_manager"):
        assert manager.load(target, "latest") == tmp_path / "1"
    assert torch.equal(target.loaded["model"]["w"], torch.full((8,), 1.0))
    assert f"Skipping checkpoint {tmp_path / '2'}" in caplog.text


def test_without_keep_previous_nothing_is_pruned(tmp_path):
    manager = CheckpointManager(tmp_path, logger=LOGGER, best=BestCheckpoints("val/loss", "min", 1))
    for step in (1, 2, 3):
        assert manager.save(step, state(float(step))) is None
    assert manager.log(3, {"val/loss": 0.2}) is None  # scored after the save: still nothing removed
    assert manager.close() is None
    assert checkpoint_steps(tmp_path) == [1, 2, 3]
    assert manager.best_checkpoint == tmp_path / "3"
