"""TensorBoardHook: event files read back with TensorBoard's own EventAccumulator."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from helper_hooks import LoadHook, LogHook, SaveAtStep
from PIL import Image
from pydantic import ValidationError
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tiny_trainer import TinyTrainer

from trainloop import BaseHook
from trainloop.hook_machinery.registry import HOOK_TYPES, hook_settings_model
from trainloop.hooks.tensorboard import TensorBoardHook


def read_events(log_dir: Path) -> EventAccumulator:
    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "images": 0})
    events.Reload()
    return events


def scalars(events: EventAccumulator, tag: str) -> list[tuple[int, float]]:
    return [(e.step, e.value) for e in events.Scalars(tag)]


def picture() -> Image.Image:
    image = Image.new("RGB", (5, 3))
    image.putdata([(40 * x, 80 * y, 7) for y in range(3) for x in range(5)])
    return image


def test_scalars_and_images_are_written_under_the_workspace(tmp_path):
    log = LogHook({"run": 1.0}, images={2: {"samples": {"pic": picture(), "grey": picture().convert("L")}}})
    TinyTrainer(max_steps=3, workspace=tmp_path, hooks=[TensorBoardHook(), log], metrics_file=False).train()

    events = read_events(tmp_path / "tensorboard")
    assert set(events.Tags()["scalars"]) == {"loss/mse", "run"}
    mse = scalars(events, "loss/mse")
    assert [s for s, _ in mse] == [1, 2, 3]
    assert [v for _, v in mse] == pytest.approx(list(log.logged.values()))
    assert scalars(events, "run") == [(1, 1.0), (2, 1.0), (3, 1.0)]

    assert set(events.Tags()["images"]) == {"samples/pic", "samples/grey"}
    (pic,) = events.Images("samples/pic")
    assert (pic.step, pic.width, pic.height) == (2, 5, 3)
    with Image.open(io.BytesIO(pic.encoded_image_string)) as back:
        assert back.convert("RGB").tobytes() == picture().tobytes()
    (grey,) = events.Images("samples/grey")
    with Image.open(io.BytesIO(grey.encoded_image_string)) as back:
        assert back.convert("L").tobytes() == picture().convert("L").tobytes()


def test_resume_purges_steps_after_the_checkpoint(tmp_path):
    checkpoint = tmp_path / "step3.pt"
    # A first attempt runs to step 6 but its last checkpoint is step 3 (then it "dies").
    TinyTrainer(
        max_steps=6,
        workspace=tmp_path,
        hooks=[TensorBoardHook(), LogHook({"run": 1.0}), SaveAtStep(3, checkpoint)],
    ).train()
    assert [s for s, _ in scalars(read_events(tmp_path / "tensorboard"), "run")] == [1, 2, 3, 4, 5, 6]

    resumed = TinyTrainer(
        max_steps=5, workspace=tmp_path, hooks=[LoadHook(checkpoint), TensorBoardHook(), LogHook({"run": 2.0})]
    )
    resumed.train()

    events = read_events(tmp_path / "tensorboard")
    # Steps 4-6 of the first attempt are gone; 4-5 are the resumed run's; 6 was never redone.
    assert scalars(events, "run") == [(1, 1.0), (2, 1.0), (3, 1.0), (4, 2.0), (5, 2.0)]
    assert [s for s, _ in scalars(events, "loss/mse")] == [1, 2, 3, 4, 5]


def test_events_are_flushed_when_a_checkpoint_is_written(tmp_path):
    class CheckpointAtTwo(BaseHook):
        seen: list[int] | None = None

        def on_after_step(self, trainer):
            if trainer.step == 2:
                trainer.request_checkpoint()

        def on_enter_checkpointing(self, trainer):
            # Read while training is still running: the writer must have flushed by now.
            self.seen = [s for s, _ in scalars(read_events(tmp_path / "tensorboard"), "run")]

    probe = CheckpointAtTwo()
    TinyTrainer(max_steps=4, workspace=tmp_path, hooks=[TensorBoardHook(), LogHook({"run": 1.0}), probe]).train()
    assert probe.seen == [1, 2]


def test_relative_and_absolute_log_dirs(tmp_path):
    TinyTrainer(
        max_steps=1, workspace=tmp_path / "ws", hooks=[TensorBoardHook(log_dir="tb/a"), LogHook({"run": 1.0})]
    ).train()
    assert scalars(read_events(tmp_path / "ws" / "tb" / "a"), "run") == [(1, 1.0)]

    # An absolute folder needs no workspace.
    TinyTrainer(max_steps=1, hooks=[TensorBoardHook(log_dir=tmp_path / "abs"), LogHook({"run": 1.0})]).train()
    assert scalars(read_events(tmp_path / "abs"), "run") == [(1, 1.0)]


@pytest.mark.parametrize("log_dir", [None, "relative/dir"])
def test_missing_workspace_fails_naming_hook_and_setting(log_dir):
    trainer = TinyTrainer(max_steps=1, hooks=[TensorBoardHook(log_dir=log_dir)])
    with pytest.raises(ValueError, match=r"TensorBoardHook 'tensor_board_hook'.*`workspace` setting is None"):
        trainer.train()


def test_bad_records_and_images_name_their_key(tmp_path):
    class Bad(BaseHook):
        def __init__(self, records=None, images=None):
            self.records, self.images = records, images

        def on_after_step(self, trainer):
            if self.records is not None:
                trainer.log(self.records)
            if self.images is not None:
                trainer.log_images(self.images)

    with pytest.raises(TypeError, match=r"'a/b' is a str, not a number"):
        TinyTrainer(
            max_steps=1, workspace=tmp_path, hooks=[TensorBoardHook(), Bad(records={"a": {"b": "x"}})]
        ).train()
    with pytest.raises(ValueError, match=r"'v' is a tensor of shape \(2,\)"):
        TinyTrainer(
            max_steps=1, workspace=tmp_path, hooks=[TensorBoardHook(), Bad(records={"v": torch.ones(2)})]
        ).train()
    with pytest.raises(TypeError, match=r"'img' is a Tensor, not a PIL image"):
        TinyTrainer(
            max_steps=1,
            workspace=tmp_path,
            hooks=[TensorBoardHook(), Bad(images={"img": torch.zeros(3, 2, 2)})],
        ).train()


@pytest.mark.parametrize("kwargs", [{"log_dir": 5}, {"log_dir": ["a"]}, {"logdir": "a"}])
def test_invalid_parameters_are_rejected(kwargs):
    with pytest.raises(ValidationError, match="log_dir|logdir"):
        TensorBoardHook(**kwargs)


def test_declarable_in_settings(tmp_path):
    assert HOOK_TYPES["tensorboard"] is TensorBoardHook
    hook = (
        hook_settings_model(TensorBoardHook).model_validate({"type": "tensorboard", "log_dir": "tb"}).build()
    )
    assert hook.log_dir == Path("tb")
    assert (
        hook_settings_model(TensorBoardHook).model_validate({"type": "tensorboard"}).build().log_dir is None
    )
