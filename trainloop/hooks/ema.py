"""``EmaHook``: an exponential moving average of the model's weights, kept through checkpoints."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

from pydantic import Field, validate_call
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from trainloop.hook_machinery.base import BaseHook
from trainloop.hook_machinery.registry import register_hook

if TYPE_CHECKING:
    from trainloop.core.run_state import TrainerView

__all__ = ["EmaHook"]

Decay = Annotated[float, Field(gt=0, lt=1, strict=True)]


@register_hook("ema")
class EmaHook(BaseHook):
    """Keep an exponential moving average (EMA) of the model's weights.

    After each optimizer step, ``ema = decay * ema + (1 - decay) * weights``; the first update
    copies the weights. Buffers (e.g. batch-norm statistics) are averaged the same way.
    ``ema_model`` is a ``torch.optim.swa_utils.AveragedModel`` of
    ``trainer.unwrapped_model``; call it like the model (``hook.ema_model(x)``) or read
    ``hook.ema_model.module``. Its state (weights and the count of updates) is saved in the
    trainer's ``state_dict`` under the hook's ``name`` and restored from it.

    Args:
        decay: Weight of the running average at each update, in (0, 1).

    Attributes:
        ema_model: The averaged model; ``None`` until training starts (or a checkpoint loads).
    """

    reads_whole_parameters = True

    @validate_call
    def __init__(self, decay: Decay = 0.9999) -> None:
        self.decay = decay
        self.ema_model: AveragedModel | None = None

    def _ensure_ema_model(self, trainer: TrainerView) -> AveragedModel:
        if self.ema_model is None:
            # No ``device`` argument: the copy stays where the model is, and ``n_averaged``
            # stays on the CPU, so the ``n_averaged == 0`` test in ``update_parameters`` is
            # not a device sync.
            self.ema_model = AveragedModel(
                trainer.unwrapped_model,
                multi_avg_fn=get_ema_multi_avg_fn(self.decay),  # type: ignore[no-untyped-call]  # unannotated in torch
                use_buffers=True,
            )
            self.ema_model.requires_grad_(False)
        return self.ema_model

    def on_before_train(self, trainer: TrainerView) -> None:
        """Create the averaged model (unless a checkpoint already restored it)."""
        self._ensure_ema_model(trainer)

    def on_after_step(self, trainer: TrainerView) -> None:
        """Fold the freshly stepped weights into the average."""
        self.ema_model.update_parameters(trainer.unwrapped_model)  # type: ignore[union-attr]

    def on_state_dict(self, trainer: TrainerView, state_dict: dict[str, Any]) -> None:
        """Save the averaged weights and the update count under ``self.name``."""
        # Also before training starts: a loader that fills a template state dict in place
        # (torch.distributed.checkpoint) needs the entry to exist while restoring.
        state_dict[self.name] = self._ensure_ema_model(trainer).state_dict()

    def on_load_state_dict(self, trainer: TrainerView, state_dict: dict[str, Any]) -> None:
        """Restore the average saved under ``self.name``.

        A checkpoint without it (saved by a run without this hook) starts a fresh average from
        the restored weights, with a warning.
        """
        ema_model = self._ensure_ema_model(trainer)
        saved = state_dict.get(self.name)
        if saved is None:
            trainer.logger.warning(
                "%s: the checkpoint holds no EMA state under %r; starting the average from the "
                "restored weights",
                type(self).__name__, self.name,
            )
            return
        ema_model.load_state_dict(saved)
