"""``StepInfo``: what the step in progress did, as hooks read it (``trainer.step_info``).

The loop starts a fresh one when a step begins (``begin_step``) and fills it as the step runs:
each microstep's loss, records and data time, then the update's gradient norm and time. Hooks
read it, complete, in ``on_after_step``, and may add to it for the hooks after them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["StepInfo"]


@dataclass(slots=True)
class StepInfo:
    """What the step in progress did, as ``trainer.step_info``: complete in ``on_after_step``.

    Attributes:
        data_time: Seconds spent drawing batches, per microstep (skipped batches included; every
            attempt of a retried step).
        loss: Each microstep's loss as a detached tensor (per item for ``Loss``); reading one is
            a host sync, so do it only on steps where you emit.
        records: Each microstep's records, as ``forward`` returned them.
        items: Each microstep's ``Loss.count`` (an int or a tensor left on its device); empty
            when ``forward`` returns plain losses.
        non_finite_grad_retries: How often this step was redone.
        skipped_update: The step whose update the loop learned, during this step, that the
            optimizer skipped on the device (non-finite gradients; see docs/machine.md): the
            previous step, or this one when the run validates, saves or ends after it.
        grad_norm: The total gradient norm before clipping (a tensor), with ``grad_clip`` only (several
            optimizers: the last update's).
        losses: With several optimizers, each microstep's loss by the optimizer whose update it
            was (``loss`` holds them all, in order).
        grad_norms: With several optimizers and ``grad_clip``, each update's norm by optimizer.
        step_time: Seconds from the step's start to the end of its applied update.
        compiled: Set when ``torch.compile`` compiled during this step (see
            ``trainloop.core.compiling``): its time is not the model's.
        extras: What hooks publish for later hooks, by a name of their choosing
            (``step_info["max_memory"]``, ``step_info["stats"]``); ``step_info[key]`` reads and writes it.
    """

    data_time: list[float] = field(default_factory=list)
    loss: list[torch.Tensor] = field(default_factory=list)
    records: list[Mapping[str, Any]] = field(default_factory=list)
    items: list[torch.Tensor | int] = field(default_factory=list)
    non_finite_grad_retries: int = 0
    skipped_update: int | None = None
    grad_norm: torch.Tensor | None = None
    losses: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    grad_norms: dict[str, torch.Tensor] = field(default_factory=dict)
    step_time: float | None = None
    compiled: Any = None  # a trainloop.machine.trace.CompileMark
    extras: dict[str, Any] = field(default_factory=dict)

    # Read and written like a dict too (``step_info["loss"]``, ``step_info["max_memory"] = ...``): a
    # field by its name, any other key in ``extras``. A field that holds ``None`` (no clipping: no
    # ``grad_norm``) is absent, as a dict without that key.

    def __getitem__(self, key: str) -> Any:
        """A field by its name (``KeyError`` while it holds ``None``), else ``extras[key]``."""
        if key in _STEP_INFO_FIELDS:
            value = getattr(self, key)
            if value is None:
                raise KeyError(key)
            return value
        return self.extras[key]

    def __setitem__(self, key: str, value: Any) -> None:
        """Set a field by its name, else ``extras[key]``."""
        if key in _STEP_INFO_FIELDS:
            setattr(self, key, value)
        else:
            self.extras[key] = value

    def __contains__(self, key: object) -> bool:
        """Whether ``self[key]`` would find a value."""
        if key in _STEP_INFO_FIELDS:
            return getattr(self, key) is not None
        return key in self.extras

    def get(self, key: str, default: Any = None) -> Any:
        """``self[key]`` if present, else ``default``."""
        return self[key] if key in self else default


_STEP_INFO_FIELDS = frozenset(StepInfo.__dataclass_fields__) - {"extras"}
