"""The retry policy for an update that found non-finite gradients: another try, or a clear error.

``stepping`` asks it after a refused update; ``retrying`` is entered only when it allows another try.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainloop.run_state import TrainerView

__all__ = ["raise_if_no_retries_left"]


def raise_if_no_retries_left(trainer: TrainerView, retries: int) -> float:
    """Raise unless the step may be tried again after ``retries`` retries; return the loss scale.

    Without a grad scaler, ``settings.max_non_finite_grad_retries`` counts the tries. Under fp16,
    GradScaler refuses updates while it finds its scale, so a floor on the scale
    (``settings.min_loss_scale``), not a count, tells that from gradients non-finite at any scale
    (fairseq's and DeepSpeed's ``min_loss_scale``); a declared count bounds it too.

    Returns:
        Under fp16, GradScaler's scale now (one more host sync, on refused updates only); else 0.

    Raises:
        RuntimeError: No retry is left; the message says which bound was met.
    """
    t = trainer
    declared = t.settings.max_non_finite_grad_retries
    scale = 0.0
    if t.grad_scaler.is_enabled():
        scale = t.grad_scaler.get_scale()
        floor = t.settings.min_loss_scale
        if scale < floor:
            raise RuntimeError(
                f"non-finite gradients at step {t.step} after {retries} retries: under fp16 "
                f"the loss scale fell to {scale:g}, below min_loss_scale={floor:g}, so the "
                "gradients are non-finite at any scale (a NaN or inf in the loss or the model?)"
            )
        if declared is None or retries < declared:
            return scale
    elif retries < (declared or 0):
        return scale
    if not declared:
        raise RuntimeError(
            f"non-finite gradients at step {t.step}; max_non_finite_grad_retries is "
            f"{declared}, so the step is not retried"
        )
    note = f"; the loss scale is now {scale:g}" if t.grad_scaler.is_enabled() else ""
    raise RuntimeError(
        f"non-finite gradients at step {t.step} after {retries} retries "
        f"(max_non_finite_grad_retries={declared}){note}"
    )
