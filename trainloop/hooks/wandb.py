"""``WandbHook``: logged records and images sent to Weights & Biases, one run per workspace."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import Field, validate_call

from trainloop.distributed.ranks import is_rank_zero
from trainloop.hook_machinery.base import BaseHook
from trainloop.hook_machinery.checks import HookProblem, workspace_only
from trainloop.hook_machinery.registry import register_hook
from trainloop.utils import flatten_nested_dict, to_float

if TYPE_CHECKING:
    from trainloop.core.run_state import TrainerView

__all__ = ["RUN_ID_FILE", "WandbHook"]

#: Where, in the workspace, the hook keeps the id of its wandb run.
RUN_ID_FILE = "wandb_run_id"


@register_hook("wandb")
class WandbHook(BaseHook):
    """Send ``trainer.log`` records and ``trainer.log_images`` images to a wandb run, on rank 0.

    Records are logged at ``step=trainer.step`` with nested keys joined by ``/``; images (PIL
    images) as ``wandb.Image``. The run's config holds the trainer's settings, updated with
    ``config``. wandb's local files go to ``<workspace>/wandb`` unless ``WANDB_DIR`` or a ``dir``
    argument says otherwise.

    The run id is kept in ``<workspace>/wandb_run_id``: a run resumed from a checkpoint
    (``trainer.step > 0`` when training starts) continues that wandb run (``resume="allow"``);
    a run starting from step 0 begins a new one and records its id. wandb keeps a run's steps
    increasing, so steps an earlier attempt logged past the checkpoint are not overwritten:
    wandb drops the resumed run's entries for them until it passes them.

    The run is finished when training ends, marked failed (exit code 1) if it ended by an
    error. ``wandb`` is imported only when training starts.

    Args:
        project: The wandb project.
        config: Extra entries for the run's config (over the trainer's settings).
        tags: Tags of the run.
        image_format: File type wandb stores images as.
        **wandb_kwargs: Further arguments of ``wandb.init`` (``entity``, ``name``, ``mode``,
            ``dir``, ``settings``...); they override the hook's own (``id``, ``resume``).
            Not declarable in a settings file.

    Raises:
        ValueError: At the start of training, if the trainer has no workspace.
    """

    @classmethod
    def check_settings(cls, declared: Any, settings: Any, trainer: Any) -> list[HookProblem]:
        """The run id goes into the workspace: it needs one (see ``BaseHook.check_settings``)."""
        return workspace_only(declared, settings, "its run id to <workspace>/wandb_run_id")

    @validate_call
    def __init__(
        self,
        project: Annotated[str, Field(min_length=1)],
        config: dict[str, Any] | None = None,
        tags: list[str] | None = None,
        image_format: Literal["png", "jpg", "jpeg", "bmp"] = "png",
        **wandb_kwargs: Any,
    ) -> None:
        self.project = project
        self.config = config
        self.tags = tags
        self.image_format = image_format
        self.wandb_kwargs = wandb_kwargs
        self.run: Any = None  # the wandb.Run, on rank 0 while training

    def on_before_train(self, trainer: TrainerView) -> None:
        """Start (or, when resuming, continue) the wandb run on rank 0."""
        if trainer.workspace is None:
            raise ValueError(
                f"{type(self).__name__} {self.name!r} keeps its run id in "
                f"<workspace>/{RUN_ID_FILE}, but the trainer's `workspace` setting is None; "
                "set workspace=..."
            )
        if not is_rank_zero():
            return
        import wandb  # slow, and only needed when the hook is used

        id_file = trainer.workspace / RUN_ID_FILE
        run_id = None  # wandb makes a new id
        if trainer.step > 0 and id_file.is_file():
            run_id = id_file.read_text(encoding="utf-8").strip() or None
        config = trainer.settings.model_dump(mode="json")
        config.update(self.config or {})
        init_kwargs: dict[str, Any] = {
            "project": self.project,
            "config": config,
            "tags": self.tags,
            "id": run_id,
            "resume": "allow",
        }
        if "WANDB_DIR" not in os.environ:
            # The run's local files belong with the rest of the run's artefacts.
            init_kwargs["dir"] = str(trainer.workspace)
        init_kwargs.update(self.wandb_kwargs)
        trainer.workspace.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(**init_kwargs)
        id_file.write_text(self.run.id, encoding="utf-8")
        trainer.logger.info("wandb run %s (project %s)", self.run.id, self.project)

    def on_log(self, trainer: TrainerView, records: dict[str, Any]) -> None:
        """Log the records at ``trainer.step``."""
        if self.run is None:
            return
        flat = {key: to_float(value, key) for key, value in flatten_nested_dict(records).items()}
        self.run.log(flat, step=trainer.step)

    def on_log_images(self, trainer: TrainerView, records: dict[str, Any]) -> None:
        """Log the PIL images at ``trainer.step``."""
        if self.run is None:
            return
        import wandb
        from PIL import Image as PILImage

        images = {}
        for key, image in flatten_nested_dict(records).items():
            if not isinstance(image, PILImage.Image):
                raise TypeError(f"image {key!r} is a {type(image).__name__}, not a PIL image")
            if self.image_format in ("jpg", "jpeg") and image.mode not in ("RGB", "L"):
                image = image.convert("RGB")  # JPEG holds neither alpha nor palettes
            images[key] = wandb.Image(image, file_type=self.image_format)
        self.run.log(images, step=trainer.step)

    def on_after_train(self, trainer: TrainerView) -> None:
        """Finish the run; failed (exit code 1) if training ended by an error."""
        if self.run is not None:
            self.run.finish(exit_code=0 if trainer.error is None else 1)
            self.run = None

