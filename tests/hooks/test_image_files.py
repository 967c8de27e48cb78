"""ImageFileLoggerHook: real PIL images written under the workspace and read back."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from child_process import HIDDEN_GPUS
from PIL import Image
from pydantic import ValidationError
from tiny_trainer import TinyTrainer

from trainloop import BaseHook
from trainloop.hook_machinery.registry import HOOK_TYPES, hook_settings_model
from trainloop.hooks.image_files import ImageFileLoggerHook

TESTS_DIR = Path(__file__).resolve().parents[1] / "support"  # where tiny_trainer is


def gradient(mode: str = "RGB", size: tuple[int, int] = (6, 4)) -> Image.Image:
    """A small image whose every pixel differs, so a mix-up of files or pixels shows."""
    image = Image.new("RGB", size)
    image.putdata([(10 * x, 20 * y, 5 * (x + y)) for y in range(size[1]) for x in range(size[0])])
    return image.convert(mode)


class ImageLogHook(BaseHook):
    """Calls ``trainer.log_images(images)`` after the chosen steps."""

    def __init__(self, images, steps):
        self.images, self.steps = images, set(steps)

    def on_after_step(self, trainer):
        if trainer.step in self.steps:
            trainer.log_images(self.images)


def test_images_are_written_per_step_and_read_back(tmp_path):
    rgb, grey = gradient(), gradient("L")
    images = {"sample": rgb, "nested": {"grey": grey}, "a/b": rgb}
    TinyTrainer(
        max_steps=4, workspace=tmp_path, hooks=[ImageFileLoggerHook(), ImageLogHook(images, steps=[2, 4])]
    ).train()

    root = tmp_path / "visualizations"
    assert sorted(p.name for p in root.iterdir()) == ["2", "4"]
    for step in ("2", "4"):
        written = sorted(str(p.relative_to(root / step)) for p in (root / step).rglob("*.png"))
        assert written == ["a/b.png", "nested/grey.png", "sample.png"]
        with Image.open(root / step / "sample.png") as back:
            assert back.format == "PNG"
            assert back.mode == "RGB"
            assert back.tobytes() == rgb.tobytes()
        with Image.open(root / step / "nested" / "grey.png") as back:
            assert back.mode == "L"
            assert back.tobytes() == grey.tobytes()


def test_jpeg_format_converts_rgba_and_is_case_insensitive(tmp_path):
    hook = ImageFileLoggerHook(image_format="JPG")
    assert hook.image_format == "jpg"
    rgba = gradient("RGBA", size=(16, 16))
    TinyTrainer(max_steps=1, workspace=tmp_path, hooks=[hook, ImageLogHook({"x": rgba}, steps=[1])]).train()

    with Image.open(tmp_path / "visualizations" / "1" / "x.jpg") as back:
        assert back.format == "JPEG"
        assert back.mode == "RGB"
        assert back.size == (16, 16)
        # Lossy, but close to the original colours.
        assert all(
            abs(a - b) <= 40 for a, b in zip(back.getpixel((8, 8)), rgba.getpixel((8, 8))[:3], strict=True)
        )


def test_other_formats_by_extension(tmp_path):
    hook = ImageFileLoggerHook(image_format="tif")
    TinyTrainer(
        max_steps=1, workspace=tmp_path, hooks=[hook, ImageLogHook({"x": gradient()}, steps=[1])]
    ).train()
    with Image.open(tmp_path / "visualizations" / "1" / "x.tif") as back:
        assert back.format == "TIFF"
        assert back.tobytes() == gradient().tobytes()


@pytest.mark.parametrize("name", ["../escape", "a//b", "./x", "a/..", "a\\b"])
def test_names_that_leave_the_step_folder_are_refused(tmp_path, name):
    trainer = TinyTrainer(
        max_steps=1,
        workspace=tmp_path,
        hooks=[ImageFileLoggerHook(), ImageLogHook({name: gradient()}, steps=[1])],
    )
    with pytest.raises(ValueError, match="not a relative path"):
        trainer.train()
    assert (
        not (tmp_path / "escape.png").exists()
    )
    assert (
        not (tmp_path / "visualizations" / "escape.png").exists()
    )


def test_non_image_value_is_refused_with_its_name(tmp_path):
    trainer = TinyTrainer(
        max_steps=1,
        workspace=tmp_path,
        hooks=[ImageFileLoggerHook(), ImageLogHook({"g": {"h": [1, 2]}}, steps=[1])],
    )
    with pytest.raises(TypeError, match=r"'g/h' is a list, not a PIL image"):
        trainer.train()


def test_missing_workspace_fails_naming_hook_and_setting():
    trainer = TinyTrainer(max_steps=1, hooks=[ImageFileLoggerHook()])
    with pytest.raises(
        ValueError, match=r"ImageFileLoggerHook 'image_file_logger_hook'.*`workspace` setting is None"
    ):
        trainer.train()
    assert trainer.step == 0


@pytest.mark.parametrize("image_format", ["psd", "h5", "wmf", "", "png ", ".png", 5, None])
def test_unknown_image_format_is_rejected(image_format):
    with pytest.raises(ValidationError, match="image_format"):
        ImageFileLoggerHook(image_format=image_format)


def test_declarable_in_settings():
    assert HOOK_TYPES["image_files"] is ImageFileLoggerHook
    model = hook_settings_model(ImageFileLoggerHook)
    assert (
        model.model_validate({"type": "image_files", "image_format": "webp"}).build().image_format == "webp"
    )
    with pytest.raises(ValidationError, match="image_format"):
        model.model_validate({"type": "image_files", "image_format": "psd"})


RANK_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch.distributed as dist
    from PIL import Image
    sys.path.insert(0, sys.argv[1])
    from tiny_trainer import TinyTrainer
    from trainloop import BaseHook
    from trainloop.distributed import destroy
    from trainloop.hooks.image_files import ImageFileLoggerHook

    class LogRank(BaseHook):
        def on_after_step(self, trainer):
            trainer.log_images({f"rank{dist.get_rank()}": Image.new("RGB", (2, 2))})

    dist.init_process_group("gloo")
    try:
        TinyTrainer(max_steps=1, workspace=sys.argv[2], hooks=[ImageFileLoggerHook(), LogRank()]).train()
    finally:
        destroy(barrier=sys.exc_info()[0] is None)  # wait for every rank: a clean gloo exit
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_only_rank_zero_writes(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    env = {**os.environ, **HIDDEN_GPUS, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": "2"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(TESTS_DIR), str(tmp_path / "ws")],
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    written = sorted(p.name for p in (tmp_path / "ws" / "visualizations" / "1").iterdir())
    assert written == ["rank0.png"]
