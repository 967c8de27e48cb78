"""How long a run is: ``max_steps``, ``max_epochs``, whichever comes first.

``RunLength`` answers the trainer's exit policy (``should_exit``) and the "last step" half of the
``every(n)`` rule (``trainloop.hook_machinery.schedule``), so both read one definition of where a run ends.
It is also where a run reads how many batches make a step (``accumulation``): the step, the plan
of a run by epochs and the checkpoint's global batch all take it from here.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from trainloop.core.data import DataExhaustedError, batches_per_epoch

if TYPE_CHECKING:
    from trainloop.core.data import EpochIterator
    from trainloop.settings.model import TrainerSettings

__all__ = ["RunLength"]


class RunLength:
    """Where a run ends, by steps, by epochs, or by both (whichever comes first).

    Args:
        settings: The run's settings (``max_steps``, ``max_epochs``,
            ``gradient_accumulation_steps``).

    Attributes:
        accumulation: Batches (microsteps) per optimizer update: ``gradient_accumulation_steps``, the one place a
            run reads it.
        epochs_at_start: Full passes completed when this run began drawing (resumed ones).
        planned_steps: The steps the run is expected to take: ``max_steps``, or with
            ``max_epochs`` ``max_epochs * ceil(len(loader) / gradient_accumulation_steps)`` when
            that is less (an epoch's last step takes the batches that remain; an estimate when
            ``forward`` skips batches by returning ``loss=None``).
            ``None`` until ``plan`` has seen the data loader, unless ``max_steps`` alone is set.
    """

    def __init__(self, settings: TrainerSettings) -> None:
        self.max_steps = settings.max_steps
        self.max_epochs = settings.max_epochs
        self.accumulation = settings.gradient_accumulation_steps
        self.planned_steps: int | None = self.max_steps if self.max_epochs is None else None
        self._data: EpochIterator | None = None
        self.epochs_at_start = 0

    def plan(self, loader: Any) -> None:
        """Derive ``planned_steps`` from the data loader's length.

        Raises:
            ValueError: ``max_epochs`` is set and the loader has no ``len()`` (a one-shot
                iterator, an ``IterableDataset`` without a length).
            DataExhaustedError: ``max_epochs`` is set and the loader's length is 0.
        """
        if self.max_epochs is None:
            return
        length = batches_per_epoch(loader)
        if length is None:
            raise ValueError(
                f"max_epochs={self.max_epochs} needs a data loader with a length, but "
                f"build_data_loader() returned a {type(loader).__name__} without len(); "
                "set max_steps instead"
            )
        if length == 0:
            raise DataExhaustedError(
                f"max_epochs={self.max_epochs}, but the data loader from build_data_loader() has "
                "no batch (len 0): there is nothing to train on"
            )
        by_epochs = self.max_epochs * math.ceil(length / self.accumulation)
        self.planned_steps = by_epochs if self.max_steps is None else min(self.max_steps, by_epochs)

    def follow(self, data: EpochIterator) -> None:
        """Read epochs from this iterator (the one the run draws from)."""
        self._data = data
        self.epochs_at_start = data.epochs_completed

    @property
    def epochs_completed(self) -> int:
        """Full passes over the data so far (0 before the data iterator exists)."""
        return self._data.epochs_completed if self._data is not None else 0

    def reached(self, step: int) -> bool:
        """Whether the run ends after ``step``: ``max_steps`` reached or ``max_epochs`` completed."""
        if self.max_steps is not None and step >= self.max_steps:
            return True
        return self.max_epochs is not None and self.epochs_completed >= self.max_epochs
