"""``ImageFileLoggerHook``: images given to ``trainer.log_images`` as files in the workspace."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import AfterValidator, validate_call

from trainloop.distributed.ranks import is_rank_zero
from trainloop.hook_machinery.base import BaseHook
from trainloop.hook_machinery.checks import HookProblem, workspace_only
from trainloop.hook_machinery.registry import register_hook
from trainloop.utils import flatten_nested_dict

if TYPE_CHECKING:
    from PIL.Image import Image

    from trainloop.core.run_state import TrainerView

__all__ = ["ImageFileLoggerHook"]


@cache
def _savable_extensions() -> dict[str, str]:
    """File extension (no dot, lower case) -> PIL format name, for formats PIL can write."""
    import sys

    from PIL import Image  # only when the hook is used

    Image.init()
    savable = {}
    for extension, fmt in Image.registered_extensions().items():
        save = Image.SAVE.get(fmt)
        # Stub plugins (BUFR, GRIB, HDF5, WMF) only save through a handler registered with
        # their module's ``register_handler``; without one, saving fails.
        if save is None or hasattr(sys.modules.get(save.__module__), "register_handler"):
            continue
        savable[extension[1:]] = fmt
    return savable


def _check_image_format(value: str) -> str:
    extension = value.lower()
    known = _savable_extensions()
    if extension not in known:
        raise ValueError(
            f"PIL cannot save images as {value!r}; use one of {', '.join(sorted(known))}"
        )
    return extension


#: A file extension PIL can save to (``"png"``, ``"jpg"``, ``"webp"``...), case-insensitive.
ImageFormat = Annotated[str, AfterValidator(_check_image_format)]


@register_hook("image_files")
class ImageFileLoggerHook(BaseHook):
    """Write the images given to ``trainer.log_images`` as files, on rank 0.

    ``trainer.log_images({"samples": {"a": img}})`` at step 12 writes
    ``<workspace>/visualizations/12/samples/a.png``: nested names, and ``/`` inside a name,
    become subfolders. An image the format cannot hold as it is (RGBA as JPEG, say) is
    converted to RGB first. Values must be PIL images.

    Args:
        image_format: File extension of a format PIL can save (``"png"``, ``"jpg"``,
            ``"webp"``...); it also chooses the format.

    Raises:
        ValueError: At the start of training, if the trainer has no workspace.
    """

    @classmethod
    def check_settings(cls, declared: Any, settings: Any, trainer: Any) -> list[HookProblem]:
        """The images go under the workspace: it needs one (see ``BaseHook.check_settings``)."""
        return workspace_only(declared, settings, "images to <workspace>/visualizations")

    @validate_call
    def __init__(self, image_format: ImageFormat = "png") -> None:
        self.image_format = image_format
        self._pil_format = _savable_extensions()[image_format]
        self._root: Path | None = None

    def on_before_train(self, trainer: TrainerView) -> None:
        """Resolve the output folder; only rank 0 writes."""
        if trainer.workspace is None:
            raise ValueError(
                f"{type(self).__name__} {self.name!r} writes images to <workspace>/visualizations, "
                "but the trainer's `workspace` setting is None; set workspace=..."
            )
        self._root = trainer.workspace / "visualizations" if is_rank_zero() else None

    def on_log_images(self, trainer: TrainerView, records: dict[str, Any]) -> None:
        """Save each image as ``<workspace>/visualizations/<step>/<name>.<image_format>``."""
        if self._root is None:
            return
        from PIL import Image as PILImage

        folder = self._root / str(trainer.step)
        for name, image in flatten_nested_dict(records).items():
            if not isinstance(image, PILImage.Image):
                raise TypeError(f"image {name!r} is a {type(image).__name__}, not a PIL image")
            *folders, stem = _name_parts(name)
            path = folder.joinpath(*folders, f"{stem}.{self.image_format}")
            path.parent.mkdir(parents=True, exist_ok=True)
            self._save(image, path)

    def _save(self, image: Image, path: Path) -> None:
        try:
            image.save(path, format=self._pil_format)
        except OSError:
            # The format cannot hold this mode (e.g. RGBA or I;16 as JPEG); RGB every format takes.
            if image.mode == "RGB":
                raise
            image.convert("RGB").save(path, format=self._pil_format)


def _name_parts(name: str) -> list[str]:
    """The folders and file stem of an image name, refusing names that leave the step folder."""
    parts = name.split("/")
    if any(part in ("", ".", "..") or "\\" in part for part in parts):
        raise ValueError(
            f"image name {name!r} is not a relative path of plain names (no empty parts, "
            "'.', '..' or backslashes)"
        )
    return parts

