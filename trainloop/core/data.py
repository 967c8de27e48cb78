"""Drawing batches across epochs from whatever ``build_data_loader`` returned."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from trainloop.core.data_position import (
    batch_size_of,
    capture_epoch_start,
    describe_order,
    has_sampler,
    per_draw,
    resume_in_epoch,
    warn_inexact_resume,
)

__all__ = ["DataExhaustedError", "EpochIterator", "batches_per_epoch"]


def batches_per_epoch(loader: Iterable[Any]) -> int | None:
    """``len(loader)`` for a re-iterable loader that has a length, else ``None``."""
    if isinstance(loader, Iterator):
        return None
    try:
        return len(loader)  # type: ignore[arg-type]
    except TypeError:  # no __len__, or a DataLoader over an IterableDataset without one
        return None


class DataExhaustedError(RuntimeError):
    """The data ran out and cannot be iterated again (or never yielded anything)."""


class EpochIterator:
    """Yields batches forever from a re-iterable loader, one epoch after another.

    A re-iterable (a ``DataLoader``, a list) is iterated again when it runs out, and before
    every epoch ``set_epoch(epoch)`` is called on the loader, or else on its ``sampler``, when
    it has one (``DistributedSampler`` reshuffles that way). A one-shot iterator is drawn
    until it runs out, which is then an error.

    Args:
        loader: What ``build_data_loader`` returned.
        epoch: The epoch to start in (restored from a checkpoint).
        resumed: The loader was restored mid-run: its first epoch may be empty (it was saved
            right at the end of that epoch), and the next one then begins.
        limit: The epochs the run declares (``max_epochs``): none beyond them is begun.
        position: What :meth:`position` returned when the checkpoint was made (this rank's, or
            any rank's on another number of ranks): a ``DataLoader`` with a sampler resumes its
            epoch exactly there (see :mod:`trainloop.core.data_position`).
    """

    def __init__(
        self,
        loader: Iterable[Any],
        epoch: int = 0,
        resumed: bool = False,
        limit: int | None = None,
        position: dict[str, Any] | None = None,
    ) -> None:
        self.loader = loader
        self.epoch = epoch
        self.limit = limit
        self._one_shot = isinstance(loader, Iterator)
        self._stateful = callable(getattr(loader, "state_dict", None))
        self._sampled = has_sampler(loader)  # a DataLoader whose epoch start can be recorded
        self._epoch_start: dict[str, Any] | None = None
        self._order: dict[str, Any] | None = None  # how the epoch's global order is made
        self._consumed_before = 0  # indices of that order consumed before this epoch's first batch here
        self.batches_per_epoch = batches_per_epoch(loader)
        self._epoch_length = self.batches_per_epoch  # this epoch's: a resumed epoch may have other
        self._iterator = self._start_epoch(position if self._sampled else None)
        self._may_be_empty = resumed
        if resumed and not (self._stateful or self._sampled):
            warn_inexact_resume(loader, epoch)
        if resumed and self._stateful:
            # A restored StatefulDataLoader resumes mid-epoch; its iterator knows how far.
            self._drawn_this_epoch = int(getattr(self._iterator, "_num_yielded", 0))

    def _start_epoch(self, position: dict[str, Any] | None = None) -> Iterator[Any]:
        if not self._one_shot:
            for owner in (self.loader, getattr(self.loader, "sampler", None)):
                set_epoch = getattr(owner, "set_epoch", None)
                if callable(set_epoch):
                    set_epoch(self.epoch)
                    break
        self._drawn_this_epoch = 0
        self._epoch_length = self.batches_per_epoch
        self._consumed_before = 0
        if not self._sampled:
            return iter(self.loader)
        loader: Any = self.loader
        resumed = None if position is None else resume_in_epoch(loader, position, self.epoch)
        if resumed is None:
            self._epoch_start = capture_epoch_start(loader)
            self._order = describe_order(loader, self._epoch_start)
            return iter(loader)
        self._epoch_start, self._order = resumed.epoch_start, resumed.order
        self._consumed_before, self._drawn_this_epoch = resumed.consumed, resumed.drawn
        if resumed.length is not None:
            self._epoch_length = resumed.length
        return resumed.iterator

    def tap_first_batch(self, fn: Any) -> None:
        """Call ``fn(batch)`` with the next batch drawn, once, then draw untapped (no cost after)."""
        self._iterator = _FirstBatchTap(self, self._iterator, fn)

    def position(self) -> dict[str, Any] | None:
        """Where a ``DataLoader`` with a sampler is inside its epoch, for a checkpoint.

        For a resume on as many ranks with the same batch size: the generators' states as the epoch began
        (``epoch_start``; ``None`` in an epoch dealt out on resume) and the batches drawn since (``drawn``), with the
        batch size. For any other resume, when the sampler is one trainloop knows: how the epoch's global order is made
        (``order``) and how many of its indices all ranks consumed (``consumed``). ``None`` for other loaders, before
        an epoch's first batch and at its end (the next epoch begins from the restored generators).
        """
        length = self._epoch_length
        drawn = self._drawn_this_epoch
        if not self._sampled or (drawn == 0 and self._consumed_before == 0):
            return None
        if length is not None and drawn >= length:
            return None
        step = per_draw(self.loader) if self._order is not None else None
        return {
            "epoch_start": self._epoch_start,
            "drawn": drawn,
            "batch_size": batch_size_of(self.loader),
            "order": self._order,
            "consumed": None if step is None else self._consumed_before + drawn * step,
        }

    @property
    def epochs_completed(self) -> int:
        """Full passes over the data so far.

        The current epoch counts once its last batch is drawn (known only for a loader with ``len()``; otherwise when
        the next epoch begins).
        """
        length = self._epoch_length
        return self.epoch + (length is not None and self._drawn_this_epoch >= length)

    @property
    def remaining(self) -> int | None:
        """Batches left to draw in the current epoch, for a loader with ``len()``; else ``None``.

        At 0, the next draw begins another epoch.
        """
        length = self._epoch_length
        return None if length is None else max(0, length - self._drawn_this_epoch)

    @property
    def in_last_epoch(self) -> bool:
        """Whether the current epoch is the last that ``limit`` allows."""
        return self.limit is not None and self.epoch + 1 >= self.limit

    @property
    def resume_epoch(self) -> int:
        """The epoch a checkpoint made now should resume in.

        A loader that saves its position (``StatefulDataLoader``, or a ``DataLoader`` with a
        sampler mid-epoch, see :meth:`position`) resumes mid-epoch, so the current epoch; any
        other loader restarts its epoch on resume, so an epoch whose last
        batch was drawn counts as done (resuming must not draw it a second time).
        """
        return self.epoch if self._stateful or self.position() is not None else self.epochs_completed

    def __iter__(self) -> EpochIterator:
        return self

    def __next__(self) -> Any:
        try:
            batch = next(self._iterator)
        except StopIteration:
            batch = self._next_epoch()
        self._drawn_this_epoch += 1
        return batch

    def _next_epoch(self) -> Any:
        if self._one_shot:
            raise DataExhaustedError(
                f"the data iterator from build_data_loader() ran out after {self._drawn_this_epoch} "
                "batches and cannot be iterated again; return a re-iterable (e.g. a DataLoader) "
                "or an infinite iterator"
            ) from None
        if self._drawn_this_epoch == 0 and not self._may_be_empty:
            raise DataExhaustedError(
                f"the data loader from build_data_loader() yielded no batch in epoch {self.epoch}"
            ) from None
        if self.in_last_epoch:
            raise DataExhaustedError(
                f"the {self.limit} epoch(s) of max_epochs={self.limit} are all drawn; no batch "
                "beyond them is drawn"
            )
        self.epoch += 1
        self._may_be_empty = False
        self._iterator = self._start_epoch()
        try:
            return next(self._iterator)
        except StopIteration:
            raise DataExhaustedError(
                f"the data loader from build_data_loader() yielded no batch in epoch {self.epoch}"
            ) from None

    def close(self) -> None:
        """Close the current iterator when it can be closed, and drop it.

        Dropping the last reference is what frees a ``DataLoader``'s worker processes.
        """
        close = getattr(self._iterator, "close", None)
        if callable(close):
            close()
        self._iterator = iter(())


class _FirstBatchTap:
    """An epoch's iterator that shows its next batch to ``fn``, then puts the iterator back."""

    def __init__(self, owner: EpochIterator, iterator: Iterator[Any], fn: Any) -> None:
        self.owner, self.iterator, self.fn = owner, iterator, fn

    def __iter__(self) -> _FirstBatchTap:
        return self

    def __next__(self) -> Any:
        batch = next(self.iterator)
        self.owner._iterator = self.iterator
        self.fn(batch)
        return batch
