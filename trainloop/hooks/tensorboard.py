"""``TensorBoardHook``: logged records and images as TensorBoard event files."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import validate_call

from trainloop.distributed.ranks import is_rank_zero
from trainloop.hook_machinery.base import BaseHook
from trainloop.hook_machinery.checks import HookProblem, needs_workspace
from trainloop.hook_machinery.registry import register_hook
from trainloop.settings.types import NonEmptyPath
from trainloop.utils import flatten_nested_dict, to_float

if TYPE_CHECKING:
    from PIL.Image import Image
    from torch.utils.tensorboard import SummaryWriter

    from trainloop.core.run_state import TrainerView

__all__ = ["TensorBoardHook"]


@register_hook("tensorboard")
class TensorBoardHook(BaseHook):
    """Write ``trainer.log`` records as scalars and ``trainer.log_images`` images for TensorBoard.

    Runs on rank 0 only, through ``torch.utils.tensorboard.SummaryWriter`` (needs the
    ``tensorboard`` package). Nested record keys are joined with ``/`` (``{"loss": {"mse": x}}``
    is the scalar ``loss/mse``), at ``trainer.step``. Images must be PIL images. A run resumed
    from a checkpoint at step ``s`` purges the events of steps after ``s`` that an earlier
    attempt wrote, so the curves continue from the checkpoint. Events are flushed when a
    checkpoint is written and when training ends.

    Args:
        log_dir: Folder of the event files. ``None``: ``<workspace>/tensorboard``; a relative
            path is taken under the workspace, an absolute one as it is.

    Raises:
        ValueError: At the start of training, if the folder lies in the workspace and the
            trainer has none.
    """

    writes_to = ("log_dir",)

    @classmethod
    def check_settings(cls, declared: Any, settings: Any, trainer: Any) -> list[HookProblem]:
        """Event files under a workspace need one (see ``BaseHook.check_settings``)."""
        where = (
            f"{str(declared.log_dir)!r}, a relative path" if declared.log_dir is not None else "<workspace>/tensorboard"
        )
        return needs_workspace(settings, declared.log_dir, "log_dir", f"event files go to {where}")

    @validate_call
    def __init__(self, log_dir: NonEmptyPath | None = None) -> None:
        self.log_dir = log_dir
        self.writer: SummaryWriter | None = None

    def _resolve_log_dir(self, trainer: TrainerView) -> Path:
        if self.log_dir is not None and self.log_dir.is_absolute():
            return self.log_dir
        if trainer.workspace is None:
            raise ValueError(
                f"{type(self).__name__} {self.name!r} writes event files to "
                f"<workspace>/{self.log_dir or 'tensorboard'}, but the trainer's `workspace` "
                "setting is None; set workspace=... or give the hook an absolute log_dir"
            )
        return trainer.workspace / (self.log_dir or "tensorboard")

    def on_before_train(self, trainer: TrainerView) -> None:
        """Open the writer on rank 0, purging events past a resumed checkpoint's step."""
        log_dir = self._resolve_log_dir(trainer)
        if not is_rank_zero():
            return
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: slow

        # Steps after the checkpoint were logged by a run that did not survive; they are
        # redone now, so TensorBoard must drop the old events from this step on.
        purge_step = trainer.step + 1 if trainer.step > 0 else None
        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)

    def on_log(self, trainer: TrainerView, records: dict[str, Any]) -> None:
        """Add each record as a scalar at ``trainer.step``."""
        if self.writer is None:
            return
        for key, value in flatten_nested_dict(records).items():
            self.writer.add_scalar(key, to_float(value, key), global_step=trainer.step)

    def on_log_images(self, trainer: TrainerView, records: dict[str, Any]) -> None:
        """Add each PIL image at ``trainer.step``."""
        if self.writer is None:
            return
        for key, image in flatten_nested_dict(records).items():
            array, dataformats = _image_array(image, key)
            self.writer.add_image(key, array, global_step=trainer.step, dataformats=dataformats)

    def on_enter_checkpointing(self, trainer: TrainerView) -> None:
        """Flush, so the events up to the checkpoint are on disk with it."""
        if self.writer is not None:
            self.writer.flush()

    def on_after_train(self, trainer: TrainerView) -> None:
        """Flush and close the writer."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def _image_array(image: Image, key: str) -> tuple[Any, str]:
    """A PIL image as a uint8 array and its ``dataformats`` for ``SummaryWriter.add_image``."""
    import numpy as np
    from PIL import Image as PILImage

    if not isinstance(image, PILImage.Image):
        raise TypeError(f"image {key!r} is a {type(image).__name__}, not a PIL image")
    if image.mode == "L":
        return np.asarray(image), "HW"
    if image.mode not in ("RGB", "RGBA"):
        # TensorBoard takes 8-bit grey, RGB or RGBA; anything else (palette, 16-bit, CMYK...)
        # is shown as RGB.
        image = image.convert("RGB")
    return np.asarray(image), "HWC"

