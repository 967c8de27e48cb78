"""Switching gradient synchronisation across ranks off and on.

DDP's ``no_sync``, FSDP2's ``set_requires_gradient_sync``, without importing FSDP unless a model uses it.
"""

from __future__ import annotations

import sys
from types import TracebackType
from typing import Any, Self

from torch import nn

__all__ = ["gradient_sync"]


class gradient_sync:  # lower case: used like torch.no_grad
    """Run backward with or without synchronising gradients across ranks.

    Gradient accumulation skips the synchronisation on all but a step's last microstep::

        with gradient_sync(model, enabled=is_last_microstep):
            loss.backward()

    - DDP (and FSDP1): ``enabled=False`` enters ``model.no_sync()``.
    - FSDP2 (``fully_shard``), which has no ``no_sync()``: ``enabled`` is passed to
      ``set_requires_gradient_sync`` of every FSDP module in the model; with ``False`` the
      unsharded gradients accumulate locally and the next synchronised backward reduce-scatters
      them. Leaving a ``False`` context turns synchronisation back on.
    - Any other model: nothing happens.

    The object may be built once and entered again and again (the hot loop need not allocate):
    what the model supports is looked up at construction.

    Args:
        model: The model as wrapped (DDP, FSDP2, or plain; ``torch.compile`` seen through).
        enabled: Whether this backward synchronises gradients.
    """

    __slots__ = ("_entered", "_fsdp", "_no_sync", "enabled", "model")

    def __init__(self, model: nn.Module, enabled: bool = True) -> None:
        self.model = model
        self.enabled = enabled
        fsdp = sys.modules.get("torch.distributed.fsdp")  # never imported: no FSDP module exists
        self._fsdp = tuple(m for m in model.modules() if isinstance(m, fsdp.FSDPModule)) if fsdp else ()
        self._no_sync = getattr(model, "no_sync", None) if not self._fsdp else None
        self._entered: Any = None

    @property
    def controls_sync(self) -> bool:
        """Whether the model has gradient synchronisation to switch (DDP, FSDP1 or FSDP2)."""
        return bool(self._fsdp) or self._no_sync is not None

    def __enter__(self) -> Self:
        if self._fsdp:
            for module in self._fsdp:
                module.set_requires_gradient_sync(self.enabled, recurse=False)
        elif not self.enabled and self._no_sync is not None:
            self._entered = self._no_sync()
            self._entered.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._fsdp:
            if not self.enabled:
                for module in self._fsdp:
                    module.set_requires_gradient_sync(True, recurse=False)
        elif self._entered is not None:
            entered, self._entered = self._entered, None
            entered.__exit__(exc_type, exc, traceback)
