"""Checkpoint integrity: metadata.json, manifest.json, falling back from a bad ``latest``, saves
that fail (file too large, directory not writable, disk full at the end), and SIGKILL at
random moments of saving."""

from __future__ import annotations

import builtins
import errno
import hashlib
import json
import logging
import os
import pickle
import random
import resource
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import torch
import xxhash
from checkpoint_child import BallastHook, Child
from helper_hooks import CaptureHook
from tiny_trainer import TinyTrainer

import trainloop
from trainloop import BaseHook
from trainloop.checkpoint import (
    CheckpointError,
    CheckpointSaveError,
    checkpoint_steps,
    latest_checkpoint,
    read_checkpoint,
    read_metadata,
    verify_checkpoint,
)
from trainloop.checkpoint.manifest import write_manifest
from trainloop.hooks.checkpointing import CheckpointingHook

FORMATS = ["full", "sharded"]


# -- helpers ---------------------------------------------------------------------------------


def run(workspace: Path, max_steps: int, *hooks: BaseHook, **kwargs) -> TinyTrainer:
    trainer = TinyTrainer(max_steps=max_steps, workspace=workspace, hooks=list(hooks), **kwargs)
    trainer.train()
    return trainer


def hidden_entries(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("."))


def started_at(capture: CaptureHook) -> int:
    return capture.events("on_before_train")[0][2]


class LogEveryStep(BaseHook):
    """Logs nested records each step."""

    def on_after_step(self, trainer):
        trainer.log({"train": {"loss": torch.tensor(0.25 * trainer.step)}, "lr": 0.1, "note": "text",
                     "bad": float("nan")})
        trainer.log({"val": {"acc": 0.5}})


class Evil:
    """Unpickling this opens (creates) ``marker``: what a hostile checkpoint would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (builtins.open, (str(self.marker), "w"))


class EvilHook(BaseHook):
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def on_state_dict(self, trainer, state_dict):
        state_dict[self.name] = {"payload": Evil(self.marker)}


def damage(directory: Path, how: str) -> str:
    """Damage a saved checkpoint; return what the error must say."""
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name not in ("manifest.json", "metadata.json"))
    victim = max(files, key=lambda p: p.stat().st_size)
    if how == "truncated":
        victim.write_bytes(victim.read_bytes()[:-10])
        return f"{victim}: cannot load: truncated"
    if how == "flipped":
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
        return f"{victim}: cannot load: corrupt"
    if how == "deleted":
        victim.unlink()
        return f"missing {victim.relative_to(directory).as_posix()}"
    if how == "no manifest":
        (directory / "manifest.json").unlink()
        return "it has no manifest.json"
    if how == "bad manifest":
        (directory / "manifest.json").write_text('{"files": ')
        return f"{directory / 'manifest.json'}: not a valid manifest"
    if how == "extra file":
        (directory / "notes.txt").write_text("hello")
        return f"{directory / 'notes.txt'}: not listed in"
    raise ValueError(how)


DAMAGES = ["truncated", "flipped", "deleted", "no manifest", "bad manifest", "extra file"]


# -- what a checkpoint says about itself -----------------------------------------------------


@pytest.mark.parametrize("format", FORMATS)
def test_manifest_lists_every_file_with_its_size_and_xxh3_128(tmp_path, format):
    run(tmp_path, 2, BallastHook(numel=1000), CheckpointingHook(interval=2, format=format))
    directory = tmp_path / "checkpoints" / "2"
    manifest = json.loads((directory / "manifest.json").read_text())
    on_disk = {p.relative_to(directory).as_posix(): p for p in directory.rglob("*") if p.is_file()}
    assert manifest["manifest_version"] == 2
    assert set(manifest["files"]) == set(on_disk) - {"manifest.json"}
    assert "metadata.json" in manifest["files"]
    for rel, entry in manifest["files"].items():
        data = on_disk[rel].read_bytes()
        assert entry == {"size": len(data), "xxh3_128": xxhash.xxh3_128(data).hexdigest()}


def as_written_by_version_1(directory: Path) -> None:
    """Rewrite ``directory``'s manifest as trainloop wrote it before XXH3-128: version 1, SHA-256 entries."""
    manifest = json.loads((directory / "manifest.json").read_text())
    files = {rel: {"size": entry["size"], "sha256": hashlib.sha256((directory / rel).read_bytes()).hexdigest()}
             for rel, entry in manifest["files"].items()}
    (directory / "manifest.json").write_text(json.dumps({"manifest_version": 1, "files": files}))


@pytest.mark.parametrize("format", FORMATS)
def test_a_checkpoint_with_a_sha256_manifest_still_resumes_and_is_still_checked(tmp_path, format, caplog):
    run(tmp_path, 2, BallastHook(numel=1000), CheckpointingHook(interval=2, format=format))
    old = tmp_path / "checkpoints" / "2"
    as_written_by_version_1(old)
    assert verify_checkpoint(old).keys() == set(json.loads((old / "manifest.json").read_text())["files"])
    kept = tmp_path / "kept"
    shutil.copytree(old, kept)  # the resumed run prunes it
    capture = CaptureHook()
    run(tmp_path, 3, BallastHook(numel=1000), CheckpointingHook(interval=2, format=format), capture)
    assert started_at(capture) == 2  # resumed from the version-1 checkpoint
    # A flipped byte in it is found by its own checksum, and named as such.
    expected = damage(kept, "flipped")
    with pytest.raises(CheckpointError, match="corrupt \\(its SHA-256 differs from its manifest's\\)") as caught:
        verify_checkpoint(kept)
    assert expected in str(caught.value)


def test_metadata_json_holds_step_epoch_time_metrics_and_versions(tmp_path):
    before = datetime.now(UTC) - timedelta(seconds=1)
    # metrics_file off: no default LoggingHook, so the metrics are LogEveryStep's alone.
    run(tmp_path, 3, LogEveryStep(), CheckpointingHook(interval=3, keep_previous=1), metrics_file=False)
    text = (tmp_path / "checkpoints" / "3" / "metadata.json").read_text()
    metadata = json.loads(text)  # strict JSON: no NaN
    assert "NaN" not in text
    assert metadata == read_metadata(tmp_path / "checkpoints" / "3")
    assert before <= datetime.fromisoformat(metadata.pop("time")) <= datetime.now(UTC)
    assert metadata == {
        "step": 3,
        "epoch": 0,
        "format": "full",
        # The last logged values, flattened; non-numbers left out, NaN as null, dry runs ignored.
        "metrics": {"train/loss": 0.75, "lr": 0.1, "bad": None, "val/acc": 0.5},
        "trainloop_version": trainloop.__version__,
        "torch_version": torch.__version__,
    }
    run(tmp_path / "quiet", 1, CheckpointingHook(interval=1, format="sharded"), metrics_file=False)
    metadata = read_metadata(tmp_path / "quiet" / "checkpoints" / "1")
    assert "metrics" not in metadata
    assert metadata["format"] == "sharded"
    assert metadata["step"] == 1


def test_read_metadata_of_a_bad_file_names_it(tmp_path):
    with pytest.raises(CheckpointError, match=rf"{tmp_path / 'metadata.json'}: cannot read"):
        read_metadata(tmp_path)
    (tmp_path / "metadata.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="not a JSON object"):
        read_metadata(tmp_path)


# -- a bad checkpoint: skipped for `latest`, an error when named -------------------------------


@pytest.mark.parametrize("how", DAMAGES)
def test_a_bad_latest_falls_back_to_the_previous_complete_one(tmp_path, how, caplog):
    run(tmp_path, 3, CheckpointingHook(interval=1, keep_previous=5))
    root = tmp_path / "checkpoints"
    said = damage(root / "3", how)
    with caplog.at_level(logging.WARNING, logger="trainloop"):
        assert latest_checkpoint(root) == root / "2"
    assert f"Skipping checkpoint {root / '3'}" in caplog.text
    assert said in caplog.text
    assert latest_checkpoint(root, verify=False) == (root / "3").resolve()

    caplog.clear()
    capture = CaptureHook()
    with caplog.at_level(logging.WARNING, logger="trainloop"):
        run(tmp_path, 4, capture, CheckpointingHook(interval=1, keep_previous=5))
    assert started_at(capture) == 2
    assert said in caplog.text
    assert checkpoint_steps(root) == [1, 2, 3, 4]  # the bad 3 was replaced by a good one
    for step in (1, 2, 3, 4):
        verify_checkpoint(root / str(step))


@pytest.mark.parametrize("how", ["truncated", "flipped", "deleted"])
def test_a_bad_sharded_latest_falls_back_too(tmp_path, how, caplog):
    run(tmp_path, 2, CheckpointingHook(interval=1, keep_previous=5, format="sharded"))
    root = tmp_path / "checkpoints"
    said = damage(root / "2", how)
    assert "__0_0.distcp" in said  # the shard: the largest file
    capture = CaptureHook()
    with caplog.at_level(logging.WARNING, logger="trainloop"):
        run(tmp_path, 3, capture, CheckpointingHook(interval=1, format="sharded"))
    assert started_at(capture) == 1
    assert said in caplog.text


@pytest.mark.parametrize("how", DAMAGES)
def test_a_named_bad_checkpoint_is_an_error_naming_the_file(tmp_path, how):
    run(tmp_path, 2, CheckpointingHook(interval=2))
    directory = tmp_path / "checkpoints" / "2"
    said = damage(directory, how)
    capture = CaptureHook()
    trainer = TinyTrainer(max_steps=3, workspace=tmp_path / "b", hooks=[capture, CheckpointingHook(interval=1, load=directory)])
    with pytest.raises(CheckpointError) as error:
        trainer.train()
    assert said in str(error.value)
    assert capture.events("on_before_step") == []
    with pytest.raises(CheckpointError, match="cannot load|missing|manifest"):
        read_checkpoint(directory)


def test_no_complete_checkpoint_starts_fresh_warning_about_each(tmp_path, caplog):
    run(tmp_path, 2, CheckpointingHook(interval=1, keep_previous=5))
    root = tmp_path / "checkpoints"
    damage(root / "1", "flipped")
    damage(root / "2", "no manifest")
    capture = CaptureHook()
    with caplog.at_level(logging.WARNING, logger="trainloop"):
        run(tmp_path, 1, capture, CheckpointingHook(interval=1, keep_previous=5))
    assert started_at(capture) == 0
    assert f"Skipping checkpoint {root / '2'}" in caplog.text
    assert f"Skipping checkpoint {root / '1'}" in caplog.text


def test_reading_without_verifying(tmp_path):
    run(tmp_path, 2, CheckpointingHook(interval=2))
    directory = tmp_path / "checkpoints" / "2"
    (directory / "manifest.json").unlink()
    assert read_checkpoint(directory, verify=False)["training_state"]["step"] == 2
    with pytest.raises(CheckpointError, match="it has no manifest.json"):
        read_checkpoint(directory)


def test_code_in_a_sharded_checkpoint_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    # A hook's state with code in it: DCP pickles it as an entry; loading refuses it.
    run(tmp_path / "a", 1, EvilHook(marker), CheckpointingHook(interval=1, format="sharded"))
    with pytest.raises(CheckpointError, match=r"sharded entry 'evil_hook.payload': refused to load"):
        read_checkpoint(tmp_path / "a" / "checkpoints" / "1")
    # A hostile index (DCP's .metadata is a pickle), with a manifest that matches.
    run(tmp_path / "b", 1, CheckpointingHook(interval=1, format="sharded"))
    directory = tmp_path / "b" / "checkpoints" / "1"
    (directory / "sharded" / ".metadata").write_bytes(pickle.dumps(Evil(marker)))
    write_manifest(directory)
    trainer = TinyTrainer(max_steps=2, workspace=tmp_path / "b", hooks=[CheckpointingHook(interval=1)])
    with pytest.raises(CheckpointError, match=r"\.metadata: refused to load: .*(builtins|io)\.open"):
        trainer.train()
    assert not marker.exists()


# -- saves that fail -------------------------------------------------------------------------


@contextmanager
def file_size_limit(nbytes: int) -> Iterator[None]:
    """Files this process writes cannot grow past ``nbytes`` (RLIMIT_FSIZE): a write beyond
    fails with EFBIG, as it would on a full disk, for root too (Python ignores SIGXFSZ)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


@contextmanager
def unwritable(directory: Path) -> Iterator[None]:
    """Make ``directory`` refuse new entries: chmod for a user, the immutable flag for root."""
    if os.geteuid() != 0:
        directory.chmod(0o500)
        try:
            yield
        finally:
            directory.chmod(0o700)
        return
    result = subprocess.run(["chattr", "+i", str(directory)], capture_output=True, check=False)
    if result.returncode != 0:
        pytest.skip(f"cannot make a directory unwritable as root here: {result.stderr!r}")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(directory)], check=True)


def assert_untouched(root: Path, steps: list[int], latest: str) -> None:
    assert checkpoint_steps(root) == steps
    assert hidden_entries(root) == []
    assert os.readlink(root / "latest") == latest
    for step in steps:
        assert read_checkpoint(root / str(step))["training_state"]["step"] == step


def ballast() -> BallastHook:
    return BallastHook(numel=256 * 1024)  # 1 MB: past the limit below


LIMIT = 512 * 1024


@pytest.mark.parametrize("format", FORMATS)
def test_file_too_large_raises_naming_the_checkpoint_and_leaves_nothing(tmp_path, format):
    root = tmp_path / "checkpoints"
    run(tmp_path, 2, ballast(), CheckpointingHook(interval=1, keep_previous=5, format=format))
    trainer = TinyTrainer(max_steps=4, workspace=tmp_path, hooks=[ballast(), CheckpointingHook(interval=1, format=format)])
    with file_size_limit(LIMIT), pytest.raises(CheckpointSaveError) as error:
        trainer.train()
    message = str(error.value)
    assert message.startswith(f"could not save checkpoint {root / '3'}: ")
    assert "File too large" in message
    if format == "full":
        assert "ballast_hook.pt" in message  # the file being written
        assert isinstance(error.value.__cause__, OSError)
        assert error.value.__cause__.errno == errno.EFBIG
    assert trainer.step == 3
    assert_untouched(root, [1, 2], "2")


@pytest.mark.parametrize("async_save", [False, True])
@pytest.mark.parametrize("format", FORMATS)
def test_file_too_large_with_warn_trains_on(tmp_path, format, async_save, caplog):
    root = tmp_path / "checkpoints"
    run(tmp_path, 2, ballast(), CheckpointingHook(interval=1, keep_previous=5, format=format))
    hook = CheckpointingHook(interval=1, format=format, async_save=async_save, on_save_error="warn")
    with caplog.at_level(logging.WARNING, logger="trainloop"), file_size_limit(LIMIT):
        trainer = run(tmp_path, 5, ballast(), hook)
    assert trainer.step == 5
    failures = [r.getMessage() for r in caplog.records if "could not save checkpoint" in r.getMessage()]
    assert [m.split(":")[0] for m in failures] == [f"could not save checkpoint {root / str(s)}" for s in (3, 4, 5)]
    assert all("training goes on (on_save_error='warn')" in m for m in failures)
    assert_untouched(root, [1, 2], "2")
    # Once writes succeed again, so do the saves.
    run(tmp_path, 6, ballast(), hook)
    assert_untouched(root, [6], "6")


@pytest.mark.parametrize("format", FORMATS)
def test_a_failed_background_save_raises_at_the_next_save_or_at_the_end(tmp_path, format):
    root = tmp_path / "checkpoints"
    run(tmp_path, 2, ballast(), CheckpointingHook(interval=1, keep_previous=5, format=format))
    capture = CaptureHook()
    hook = CheckpointingHook(interval=1, keep_previous=5, format=format, async_save=True)
    trainer = TinyTrainer(max_steps=6, workspace=tmp_path, hooks=[ballast(), capture, hook])
    with file_size_limit(LIMIT), pytest.raises(CheckpointSaveError, match=rf"could not save checkpoint {root / '3'}: "):
        trainer.train()
    assert trainer.step == 4  # the write of step 3 failed behind step 4, and the save of 4 said so
    assert capture.events("on_after_train")  # the run ended through `exiting`
    assert_untouched(root, [1, 2], "2")

    trainer = TinyTrainer(max_steps=3, workspace=tmp_path, hooks=[ballast(), hook])
    with file_size_limit(LIMIT), pytest.raises(CheckpointSaveError, match=rf"could not save checkpoint {root / '3'}: "):
        trainer.train()  # the last save failed after the loop ended: the end of the run says so
    assert trainer.step == 3
    assert_untouched(root, [1, 2], "2")


class LockedOnceTraining(BaseHook):
    """Makes the checkpoint directory refuse new entries once training began, past the check before step 1."""

    def __init__(self, root: Path, stack: ExitStack) -> None:
        self.root = root
        self.stack = stack

    def on_before_train(self, trainer) -> None:
        self.stack.enter_context(unwritable(self.root))


@pytest.mark.parametrize("format", FORMATS)
def test_unwritable_directory_is_refused_before_step_one_and_a_save_refused_later_raises_or_warns(
    tmp_path, format, caplog
):
    root = tmp_path / "checkpoints"
    run(tmp_path, 2, CheckpointingHook(interval=1, keep_previous=5, format=format))
    with unwritable(root):
        trainer = TinyTrainer(max_steps=3, workspace=tmp_path, hooks=[CheckpointingHook(interval=1, format=format)])
        with pytest.raises(ValueError, match=rf"^CheckpointingHook path: {root}: the directory is not writable$"):
            trainer.train()
        assert trainer.step == 0  # refused in restoring, before anything was loaded or run
    with ExitStack() as stack:
        hooks = [LockedOnceTraining(root, stack), CheckpointingHook(interval=1, format=format)]
        with pytest.raises(CheckpointSaveError, match=rf"could not save checkpoint {root / '3'}: \[Errno (1|13)\]"):
            run(tmp_path, 3, *hooks)
    with ExitStack() as stack, caplog.at_level(logging.WARNING, logger="trainloop"):
        hooks = [LockedOnceTraining(root, stack), CheckpointingHook(interval=1, format=format, on_save_error="warn")]
        trainer = run(tmp_path, 4, *hooks)
    assert trainer.step == 4  # warned, trained on
    assert "could not save checkpoint" in caplog.text
    assert str(root / "4") in caplog.text
    assert_untouched(root, [1, 2], "2")


def test_disk_full_at_the_very_end_leaves_nothing(tmp_path, monkeypatch):
    # The last step of a save is fsyncing its files before the rename; a disk that fills up
    # under a network file system often says so only then.
    root = tmp_path / "checkpoints"
    run(tmp_path, 2, CheckpointingHook(interval=1, keep_previous=5))

    def no_space(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", no_space)
    trainer = TinyTrainer(max_steps=3, workspace=tmp_path, hooks=[CheckpointingHook(interval=1)])
    with pytest.raises(CheckpointSaveError, match=rf"{root / '3'}: \[Errno 28\] No space left on device"):
        trainer.train()
    monkeypatch.undo()
    assert_untouched(root, [1, 2], "2")


# -- SIGKILL at random moments of saving -----------------------------------------------------


def test_sigkill_while_saving_always_leaves_a_complete_latest(tmp_path):
    workspace = tmp_path / "ws"
    root = workspace / "checkpoints"
    zygote = Child(tmp_path, "save-loop", str(workspace))
    chance = random.Random(20240601)
    modes = [("full", "0"), ("full", "1"), ("sharded", "0"), ("sharded", "1")]
    kills = 24
    for kill in range(kills):
        format, async_save = modes[kill % len(modes)]
        zygote.send(f"{format} {async_save}")
        pid = int(zygote.wait_for("forked").split()[1])
        started = int(zygote.wait_for("started").split()[1])
        # Kill while the first or second save of this run is being written (in the background
        # too), at a moment the seeded generator picks: before, during or after any of its
        # files, the manifest, the rename and the symlink.
        zygote.wait_for("saving", count=chance.choice([1, 2]))
        time.sleep(chance.uniform(0.0, 0.12))
        os.kill(pid, signal.SIGKILL)
        assert zygote.wait_for("reaped") == f"reaped {pid} {-signal.SIGKILL}"
        latest = root / "latest"
        if not latest.is_symlink():  # the very first save had not made it yet
            assert checkpoint_steps(root) in ([], [1])
            continue
        # `latest` itself (not a fallback) is complete: it verifies and loads.
        verify_checkpoint(latest)
        step = int(latest.resolve().name)
        assert step >= started
        state = read_checkpoint(latest)
        assert state["training_state"]["step"] == step
        assert state["ballast_hook"]["step"] == step
        for other in checkpoint_steps(root):  # nothing half-written under a step name
            verify_checkpoint(root / str(other))
    zygote.proc.stdin.close()
    assert zygote.finish() == 0, zygote.stderr_path.read_text()

    capture = CaptureHook()
    step = int((root / "latest").resolve().name)
    run(workspace, step + 1, capture, CheckpointingHook(interval=1))
    assert started_at(capture) == step
    assert hidden_entries(root) == []
    assert checkpoint_steps(root) == [step + 1]


class Unpicklable(BaseHook):
    def on_state_dict(self, trainer, state_dict):
        state_dict[self.name] = {"fn": lambda: None}


@pytest.mark.parametrize("async_save", [False, True])
def test_a_state_that_cannot_be_written_raises_even_with_warn(tmp_path, async_save):
    root = tmp_path / "checkpoints"
    hook = CheckpointingHook(interval=1, async_save=async_save, on_save_error="warn")
    trainer = TinyTrainer(max_steps=3, workspace=tmp_path, hooks=[Unpicklable(), hook])
    with pytest.raises(CheckpointError, match=rf"could not save checkpoint {root / '1'}: .*(pickle|lambda)") as error:
        trainer.train()
    assert not isinstance(error.value, CheckpointSaveError)
    assert not root.exists()  # nothing saved, nothing left: the folder the run made for its checkpoints is gone
