"""Checkpoints on fsspec's in-memory filesystem (``memory://``): the object-storage logic, fast.

No rename there, as on S3: a checkpoint counts once its manifest is written, ``latest`` is an
object naming the step, and what an interrupted save left is ignored, then cleaned.
"""

from __future__ import annotations

import json
import logging
import uuid

import fsspec
import pytest
import torch
from pydantic import ValidationError
from tiny_trainer import TinyTrainer

from trainloop import PreflightError, TrainerSettings, ValidationHook
from trainloop.checkpoint import (
    checkpoint_steps,
    export_checkpoint,
    latest_checkpoint,
    read_checkpoint,
    read_weights,
    verify_checkpoint,
    write_checkpoint,
)
from trainloop.checkpoint.errors import CheckpointError
from trainloop.checkpoint.manager import CheckpointManager
from trainloop.checkpoint.storage import clean_leftovers
from trainloop.hooks.checkpointing import CheckpointingHook
from trainloop.location import UrlPath, location

MEMORY = fsspec.filesystem("memory")


@pytest.fixture
def root():
    """A fresh ``memory://`` directory, removed afterwards."""
    name = f"/trainloop-{uuid.uuid4().hex[:8]}"
    yield f"memory://{name.lstrip('/')}"
    if MEMORY.exists(name):
        MEMORY.rm(name, recursive=True)


def keys(url):
    prefix = "/" + url.removeprefix("memory://") + "/"
    return sorted(path[len(prefix):] for path in MEMORY.find(prefix))


def state(step, value=0.0):
    return {
        "model": {"w": torch.full((3,), value)},
        "training_state": {"step": step, "epoch": 0, "optimizer": {"state": {}, "param_groups": []}},
    }


def test_write_read_verify_and_latest_on_object_storage(root):
    first = write_checkpoint(root, 2, state(2, 1.0))
    write_checkpoint(root, 4, state(4, 2.0))
    assert str(first) == f"{root}/2"
    assert keys(root) == [
        "2/manifest.json", "2/metadata.json", "2/model.pt", "2/training_state.pt",
        "4/manifest.json", "4/metadata.json", "4/model.pt", "4/training_state.pt", "latest",
    ]
    assert MEMORY.cat_file("/" + root.removeprefix("memory://") + "/latest") == b"4\n"
    assert checkpoint_steps(root) == [2, 4]
    assert str(latest_checkpoint(root)) == f"{root}/4"
    assert torch.equal(read_checkpoint(f"{root}/4")["model"]["w"], torch.full((3,), 2.0))
    assert set(verify_checkpoint(f"{root}/4")) == {"metadata.json", "model.pt", "training_state.pt"}


def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_one(root, caplog):
    write_checkpoint(root, 2, state(2, 1.0))
    write_checkpoint(root, 4, state(4, 2.0))
    model = "/" + root.removeprefix("memory://") + "/4/model.pt"
    data = bytearray(MEMORY.cat_file(model))
    data[-30] ^= 0xFF  # same size, one flipped byte
    MEMORY.pipe_file(model, bytes(data))
    with pytest.raises(CheckpointError, match=r"4/model.pt: cannot load: corrupt"):
        read_checkpoint(f"{root}/4")
    with caplog.at_level(logging.WARNING, logger="trainloop"):
        assert str(latest_checkpoint(root)) == f"{root}/2"
    assert f"Skipping checkpoint {root}/4, which is incomplete or corrupt" in caplog.text


def test_a_checkpoint_without_its_manifest_does_not_count_and_is_cleaned(root, caplog):
    write_checkpoint(root, 2, state(2))
    write_checkpoint(root, 4, state(4))
    MEMORY.rm("/" + root.removeprefix("memory://") + "/4/manifest.json")  # as an upload killed before its end
    MEMORY.pipe_file("/" + root.removeprefix("memory://") + "/6/model.pt", b"partial")
    assert checkpoint_steps(root) == [2]
    assert str(latest_checkpoint(root)) == f"{root}/2"  # latest names 4, which does not count
    with caplog.at_level(logging.WARNING, logger="trainloop"):
        clean_leftovers(location(root), logging.getLogger("trainloop"))
    assert [key.split("/")[0] for key in keys(root)] == ["2"] * 4 + ["latest"]
    assert f"Removed {root}/4: a save or a removal that did not finish" in caplog.text
    assert f"Removed {root}/6" in caplog.text


def test_a_step_saved_again_replaces_the_old_one_whole(root):
    write_checkpoint(root, 2, {**state(2, 1.0), "extra": {"x": torch.ones(1)}})
    write_checkpoint(root, 2, state(2, 5.0))
    assert "2/extra.pt" not in keys(root)
    assert torch.equal(read_checkpoint(f"{root}/2")["model"]["w"], torch.full((3,), 5.0))


def test_pruning_removes_the_manifest_first_and_keeps_the_rest(root):
    for step in (2, 4, 6):
        write_checkpoint(root, step, state(step))
    manager = CheckpointManager(location(root), keep_previous=1, keep_steps=frozenset({2}))
    manager.write_full(8, state(8), {"step": 8})  # published, then the others pruned
    clean_leftovers(location(root), logging.getLogger("trainloop"))  # waits for the background removal
    assert checkpoint_steps(root) == [2, 6, 8]
    assert {key.split("/")[0] for key in keys(root)} == {"2", "6", "8", "latest"}


@pytest.mark.parametrize("format", ["full", "sharded"])
def test_a_hook_saves_keeps_the_best_and_resumes_exactly_on_memory(root, format):
    loss = {2: 0.5, 4: 0.1, 6: 0.9, 8: 0.2}

    def run(max_steps):
        hook = CheckpointingHook(interval=2, path=root, format=format, keep_best=1, monitor="val/loss")
        validation = ValidationHook(lambda t: {"loss": loss[t.step]}, interval=2)
        trainer = TinyTrainer(TrainerSettings(max_steps=max_steps), hooks=[validation, hook])
        return trainer, hook, trainer.train()

    run(4)
    trainer, hook, result = run(8)  # resumes from 4, whose score best.json keeps
    reference = TinyTrainer(TrainerSettings(max_steps=8))
    reference.train()
    for key, value in reference.model.state_dict().items():
        assert torch.equal(trainer.model.state_dict()[key], value), key
    assert checkpoint_steps(root) == [4, 8]  # the best and the newest
    best = json.loads(MEMORY.cat_file("/" + root.removeprefix("memory://") + "/best.json"))
    assert best == {"monitor": "val/loss", "mode": "min", "scores": {"4": 0.1, "8": 0.2}, "best": 4}
    assert str(hook.best_checkpoint) == str(result.best_checkpoint) == f"{root}/4"


def test_export_reads_and_writes_urls(root, tmp_path):
    write_checkpoint(root, 3, state(3, 7.0))
    export_checkpoint(root, f"{root}/model.safetensors")  # a checkpoints root: its latest
    export_checkpoint(f"{root}/3", tmp_path / "model.safetensors")
    for source in (f"{root}/model.safetensors", tmp_path / "model.safetensors"):
        weights = read_weights(source)
        assert torch.equal(weights.state_dict["w"], torch.full((3,), 7.0))
        assert weights.step == 3


def test_the_hook_takes_a_url_and_refuses_what_would_be_a_local_folder_named_like_one(tmp_path):
    declared = TrainerSettings.model_validate(
        {"max_steps": 2, "hooks": [{"type": "checkpointing", "interval": 2, "path": "memory://ws/ck"}]}
    )
    hook = declared.hooks[0].build()
    assert isinstance(hook.path, UrlPath)
    assert str(hook.path) == "memory://ws/ck"
    assert json.loads(declared.model_dump_json())["hooks"][0]["path"] == "memory://ws/ck"
    with pytest.raises(ValidationError, match="a URL scheme without its '//'"):
        TrainerSettings.model_validate(
            {"max_steps": 2, "hooks": [{"type": "checkpointing", "interval": 2, "path": "s3:/bucket/x"}]}
        )
    with pytest.raises(ValueError, match="storage_options are for a URL path or load"):
        CheckpointingHook(interval=2, path=tmp_path, storage_options={"anon": True})
    assert not any(tmp_path.iterdir())
    declared = {"max_steps": 2, "workspace": str(tmp_path / "ws"), "hooks": [
        {"type": "checkpointing", "interval": 2, "storage_options": {"anon": True}}
    ]}
    with pytest.raises(PreflightError) as refused:  # a settings file: the preflight says it once, in one line
        TinyTrainer(TrainerSettings.model_validate(declared)).train()
    assert str(refused.value) == (
        "hooks[0]: CheckpointingHook: storage_options are for a URL path or load, and neither is a URL"
    )


def test_cleaning_up_a_local_root_removes_only_what_a_save_writes(tmp_path):
    root = tmp_path / "checkpoints"
    root.mkdir()
    theirs = [root / ".0007.tmp-1a2b", root / ".report.csv.old-00ff", root / "0007"]
    for path in theirs:
        path.mkdir()
        (path / "data.csv").write_text("kept")
    ours = [root / ".6.tmp-1a2b", root / ".latest.tmp-00ff"]
    for path in ours:
        path.mkdir()
    TinyTrainer(max_steps=4, workspace=tmp_path, hooks=[CheckpointingHook(interval=2)]).train()
    assert all((path / "data.csv").read_text() == "kept" for path in theirs)
    assert not any(path.exists() for path in ours)
    assert checkpoint_steps(root) == [4]  # 0007 is no checkpoint
