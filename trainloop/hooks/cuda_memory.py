"""``CudaMaxMemoryHook``: the peak CUDA memory of each step, in ``step_info["max_memory"]``."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from pydantic import validate_call

from trainloop.hook_machinery.base import BaseHook
from trainloop.hook_machinery.registry import register_hook
from trainloop.utils import warn_user

if TYPE_CHECKING:
    from trainloop.core.run_state import TrainerView

__all__ = ["CudaMaxMemoryHook"]

_GIB = float(1 << 30)


@register_hook("cuda_memory")
class CudaMaxMemoryHook(BaseHook):
    """Record the peak CUDA memory allocated during each step, in GiB.

    The peak is reset when a step begins and read after the optimizer stepped, into
    ``trainer.step_info["max_memory"]`` (a float), where logging hooks pick it up. Both calls
    read the caching allocator's counters on the host: no device sync.

    On a device other than CUDA the hook does nothing, and says so once with a
    ``RuntimeWarning`` when training starts.
    """

    @validate_call
    def __init__(self) -> None:
        self._device: torch.device | None = None

    def on_before_train(self, trainer: TrainerView) -> None:
        """Check the trainer's device; warn once and stay idle if it is not CUDA."""
        if trainer.device.type == "cuda":
            self._device = trainer.device
        else:
            self._device = None
            warn_user(
                f"CudaMaxMemoryHook does nothing: the trainer's device is {str(trainer.device)!r}, "
                "not CUDA, so step_info['max_memory'] is not recorded",
                RuntimeWarning,
            )

    def on_before_step(self, trainer: TrainerView) -> None:
        """Reset the peak so it covers this step only."""
        if self._device is not None:
            torch.cuda.reset_peak_memory_stats(self._device)

    def on_after_step(self, trainer: TrainerView) -> None:
        """Store the step's peak allocation (GiB) in ``step_info["max_memory"]``."""
        if self._device is not None:
            trainer.step_info["max_memory"] = torch.cuda.max_memory_allocated(self._device) / _GIB
