"""WandbHook with the real wandb package in offline mode, read back from the run's own files."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helper_hooks import LoadHook, LogHook, SaveAtStep
from PIL import Image
from pydantic import ValidationError
from tiny_trainer import TinyTrainer

from trainloop import BaseHook
from trainloop.hook_machinery.registry import HOOK_TYPES, hook_settings_model
from trainloop.hooks.wandb import RUN_ID_FILE, WandbHook


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    """Offline, quiet wandb that writes only under tmp_path, set up afresh for this test.

    wandb reads its environment once per process setup, so the test tears it down again.
    """
    import wandb

    home = tmp_path / "wandb_home"
    for name, value in {
        "WANDB_MODE": "offline",
        "WANDB_CACHE_DIR": home / "cache",
        "WANDB_CONFIG_DIR": home / "config",
        "WANDB_DATA_DIR": home / "data",
        "WANDB_SILENT": "true",
        "WANDB_CONSOLE": "off",
        "WANDB__DISABLE_STATS": "true",
        "WANDB_DISABLE_GIT": "true",
        "WANDB_DISABLE_CODE": "true",
    }.items():
        monkeypatch.setenv(name, str(value))
    monkeypatch.delenv("WANDB_DIR", raising=False)
    wandb.teardown()
    yield home
    wandb.teardown()


# -- reading an offline run back -------------------------------------------------------------
# wandb 0.2x-0.3x no longer ships a Python reader of its ``.wandb`` transaction log, so this
# reads the documented layout: a 7-byte header (":W&B", magic 0xBEE1, version), then LevelDB
# log blocks of 32 KiB whose chunks (4-byte checksum, 2-byte length, 1-byte type) carry
# serialized ``wandb.proto.wandb_internal_pb2.Record`` messages.

_BLOCK = 32 * 1024
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def read_records(path: Path) -> list:
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    assert struct.unpack_from("<H", data, 4)[0] == 0xBEE1, path
    records, pending, pos = [], b"", 7
    while pos + 7 <= len(data):
        room = _BLOCK - pos % _BLOCK
        if room < 7:  # a block's tail too short for a chunk header is padding
            pos += room
            continue
        _, length, kind = struct.unpack_from("<IHB", data, pos)
        if kind == 0:  # zero padding up to the next block
            pos += room
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


class OfflineRun:
    """What one offline run wrote: its run record, history rows, files and exit code."""

    def __init__(self, run_dir: Path):
        self.dir = run_dir
        (log_file,) = run_dir.glob("run-*.wandb")
        self.records = read_records(log_file)
        kinds = [r.WhichOneof("record_type") for r in self.records]
        self.run = next(r.run for r in self.records if r.WhichOneof("record_type") == "run")
        self.history = [
            {
                "/".join(i.nested_key) if i.nested_key else i.key: json.loads(i.value_json)
                for i in r.history.item
            }
            for r in self.records
            if r.WhichOneof("record_type") == "history"
        ]
        self.exit_code = (
            next(r.exit.exit_code for r in self.records if r.WhichOneof("record_type") == "exit")
            if "exit" in kinds
            else None
        )
        self.config = {
            item.key: json.loads(item.value_json) for item in self.run.config.update if item.key != "_wandb"
        }

    def rows(self) -> dict[int, dict]:
        return {row["_step"]: row for row in self.history}


def offline_runs(wandb_dir: Path) -> list[Path]:
    """The offline runs wandb wrote under ``wandb_dir`` (the workspace, by default).

    ``run.finish()`` can return before wandb's service process has written everything; tearing
    the service down waits for it, so the files are complete when read.
    """
    import wandb

    wandb.teardown()
    return sorted((wandb_dir / "wandb").glob("offline-run-*"))


# -- hooks driving the runs ------------------------------------------------------------------


def picture() -> Image.Image:
    image = Image.new("RGB", (5, 3))
    image.putdata([(40 * x, 80 * y, 7) for y in range(3) for x in range(5)])
    return image


# -- tests -----------------------------------------------------------------------------------


def test_offline_run_logs_records_and_images_then_a_resumed_run_continues_it(tmp_path, offline_wandb):
    workspace, checkpoint = tmp_path / "ws", tmp_path / "step2.pt"
    hook, log = (
        WandbHook("trainloop-test", config={"lr": 0.05}, tags=["tiny"]),
        LogHook({"attempt": 1.0}, images={2: {"samples": {"pic": picture()}}}),
    )
    TinyTrainer(max_steps=4, workspace=workspace, hooks=[hook, log, SaveAtStep(2, checkpoint)]).train()

    assert hook.run is None  # finished
    run_id = (workspace / RUN_ID_FILE).read_text()
    (first_dir,) = offline_runs(workspace)  # wandb's files live in the workspace by default
    first = OfflineRun(first_dir)
    assert first.run.run_id == run_id
    assert first_dir.name.endswith(run_id)
    assert first.run.project == "trainloop-test"
    assert list(first.run.tags) == ["tiny"]
    assert first.config["lr"] == 0.05
    assert first.config["max_steps"] == 4
    assert first.config["workspace"] == str(workspace)
    rows = first.rows()
    assert sorted(rows) == [1, 2, 3, 4]
    for step, value in log.logged.items():
        assert rows[step]["loss/mse"] == pytest.approx(value)
        assert rows[step]["attempt"] == 1
    assert rows[2]["samples/pic/_type"] == "image-file"
    assert rows[2]["samples/pic/format"] == "png"
    with Image.open(first_dir / "files" / rows[2]["samples/pic/path"]) as back:
        assert back.convert("RGB").tobytes() == picture().tobytes()
    assert first.exit_code == 0

    # Resumed from the step-2 checkpoint: the same wandb run goes on.
    TinyTrainer(
        max_steps=4,
        workspace=workspace,
        hooks=[LoadHook(checkpoint), WandbHook("trainloop-test"), LogHook({"attempt": 2.0})],
    ).train()
    (second_dir,) = set(offline_runs(workspace)) - {first_dir}
    second = OfflineRun(second_dir)
    assert second.run.run_id == run_id
    assert (workspace / RUN_ID_FILE).read_text() == run_id
    assert {step: row["attempt"] for step, row in second.rows().items()} == {3: 2, 4: 2}

    # Started again from step 0 in the same workspace: a new run, whose id replaces the old.
    TinyTrainer(max_steps=1, workspace=workspace, hooks=[WandbHook("trainloop-test"), LogHook({"attempt": 3.0})]).train()
    (third_dir,) = set(offline_runs(workspace)) - {first_dir, second_dir}
    third = OfflineRun(third_dir)
    assert third.run.run_id != run_id
    assert (workspace / RUN_ID_FILE).read_text() == third.run.run_id


def test_failed_run_exits_1_and_wandb_dir_and_kwargs_are_respected(tmp_path, offline_wandb, monkeypatch):
    class Boom(BaseHook):
        def on_after_step(self, trainer):
            if trainer.step == 2:
                raise RuntimeError("boom")

    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "elsewhere"))
    (tmp_path / "elsewhere").mkdir()
    hook = WandbHook("trainloop-test", image_format="jpg", name="custom-name", job_type="unit")
    trainer = TinyTrainer(
        max_steps=5, workspace=tmp_path / "ws", hooks=[hook, LogHook({"attempt": 1.0}, images={1: {"samples": {"pic": picture()}}}), Boom()]
    )
    with pytest.raises(RuntimeError, match="boom"):
        trainer.train()

    assert offline_runs(tmp_path / "ws") == []  # WANDB_DIR wins over the workspace
    (run_dir,) = offline_runs(tmp_path / "elsewhere")
    run = OfflineRun(run_dir)
    assert run.exit_code == 1
    assert run.run.display_name == "custom-name"
    assert run.run.job_type == "unit"
    assert sorted(run.rows()) == [1, 2]
    assert run.rows()[1]["samples/pic/format"] == "jpg"
    with Image.open(run_dir / "files" / run.rows()[1]["samples/pic/path"]) as back:
        assert back.format == "JPEG"


def test_bad_images_name_their_key(tmp_path, offline_wandb):
    class Bad(BaseHook):
        def on_after_step(self, trainer):
            trainer.log_images({"x": {"y": torch.zeros(3, 2, 2)}})

    with pytest.raises(TypeError, match=r"'x/y' is a Tensor, not a PIL image"):
        TinyTrainer(max_steps=1, workspace=tmp_path, hooks=[WandbHook("p"), Bad()]).train()
    (run_dir,) = offline_runs(tmp_path)
    assert OfflineRun(run_dir).exit_code == 1


def test_missing_workspace_fails_naming_hook_and_setting(tmp_path, offline_wandb, monkeypatch):
    monkeypatch.chdir(tmp_path)
    trainer = TinyTrainer(max_steps=1, hooks=[WandbHook("p")])
    with pytest.raises(ValueError, match=r"WandbHook 'wandb_hook'.*`workspace` setting is None"):
        trainer.train()
    assert offline_runs(tmp_path) == []


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({}, "project"),
        ({"project": ""}, "project"),
        ({"project": 3}, "project"),
        ({"project": "p", "image_format": "gif"}, "image_format"),
        ({"project": "p", "tags": "one"}, "tags"),
        ({"project": "p", "config": [1]}, "config"),
    ],
)
def test_invalid_parameters_are_rejected(kwargs, field):
    with pytest.raises(ValidationError, match=field):
        WandbHook(**kwargs)


def test_declarable_in_settings():
    assert HOOK_TYPES["wandb"] is WandbHook
    model = hook_settings_model(WandbHook)
    hook = model.model_validate({"type": "wandb", "project": "p", "tags": ["a"], "config": {"k": 1}}).build()
    assert (hook.project, hook.tags, hook.config, hook.image_format) == ("p", ["a"], {"k": 1}, "png")
    # wandb.init's own arguments are code-only (**wandb_kwargs), so settings reject them.
    with pytest.raises(ValidationError, match="entity"):
        model.model_validate({"type": "wandb", "project": "p", "entity": "me"})


def test_heavy_packages_are_imported_only_when_used():
    code = (
        "import sys\n"
        "import trainloop.hooks.wandb, trainloop.hooks.tensorboard, trainloop.hooks.image_files\n"
        "import trainloop.hooks.ema, trainloop.hooks.cuda_memory\n"
        "from trainloop.hooks.wandb import WandbHook\n"
        "from trainloop.hooks.tensorboard import TensorBoardHook\n"
        "WandbHook('p'); TensorBoardHook()\n"
        "heavy = ('wandb', 'tensorboard', 'torch.utils.tensorboard', 'PIL')\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]"
