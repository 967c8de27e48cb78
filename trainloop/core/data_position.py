"""Where a plain ``torch.utils.data.DataLoader`` is in its epoch, and resuming there exactly.

A ``DataLoader`` over a map-style dataset has no state to save, but its epoch is a function of
two things: the generators its sampler shuffles with, as they were when the epoch began, and
how many batches were drawn since. :mod:`trainloop.core.data` records the first as each epoch
begins; a checkpoint saves both; a resume sets the generators back, starts the epoch again and
skips the batches already drawn *at the sampler*, so their data is never loaded (as
Accelerate's ``skip_first_batches`` does). The rest of the epoch, and every later one, is then
the unbroken run's.

What stays inexact: a loader whose workers draw random numbers (augmentation) hands the
remaining batches to its workers in another rotation than the unbroken run did; and a loader
with neither a sampler nor a state (an ``IterableDataset``, a generator) cannot be positioned
at all, which the resume says in a warning.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler, SequentialSampler

__all__ = ["InexactResumeWarning", "capture_epoch_start", "has_sampler", "replayed_epoch", "warn_inexact_resume"]


class InexactResumeWarning(UserWarning):
    """A resumed run cannot draw the data the unbroken run would have."""


def has_sampler(loader: Any) -> bool:
    """Whether ``loader`` is a ``DataLoader`` that draws indices from a sampler and keeps no state of its own.

    A sampler means a map-style dataset; ``StatefulDataLoader`` saves its own position.
    """
    return (
        isinstance(loader, DataLoader)
        and not callable(getattr(loader, "state_dict", None))
        and loader._dataset_kind == 0
    )


def _generators(loader: DataLoader[Any]) -> list[torch.Generator]:
    """The generators a loader's epoch may draw from besides torch's global one, each once."""
    found: list[torch.Generator] = []
    batch_sampler = loader.batch_sampler
    for owner in (loader, loader.sampler, getattr(batch_sampler, "sampler", None)):
        generator = getattr(owner, "generator", None)
        if isinstance(generator, torch.Generator) and all(generator is not g for g in found):
            found.append(generator)
    return found


def _draws_from_torch(loader: DataLoader[Any]) -> bool:
    """Whether the loader's order may come from torch's global generator.

    Any sampler but one whose order is fixed (``SequentialSampler``) or seeded by itself (``DistributedSampler``).
    """
    sampler = getattr(loader.batch_sampler, "sampler", loader.sampler)
    return not isinstance(sampler, (SequentialSampler, DistributedSampler))


def capture_epoch_start(loader: DataLoader[Any]) -> dict[str, Any]:
    """The generator states an epoch's shuffle is drawn from, taken just before ``iter(loader)``.

    Torch's global one (5 KB) is included only when the order may come from it.
    """
    return {
        "torch": torch.get_rng_state() if _draws_from_torch(loader) else None,
        "generators": [g.get_state() for g in _generators(loader)],
    }


class _SkipFirst:
    """An index sampler whose iterators drop its first ``skip`` items, until one of them has.

    A multi-worker ``DataLoader`` makes two as it starts and uses the second; persistent workers iterate the same object
    again next epoch, which must then not skip.
    """

    def __init__(self, sampler: Any, skip: int) -> None:
        self.sampler = sampler
        self.skip = skip
        self.made: _Skipping | None = None

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[Any]:
        if self.skip == 0:
            return iter(self.sampler)
        self.made = _Skipping(iter(self.sampler), self)
        return self.made


class _Skipping:
    """An iterator that drops its owner's first ``skip`` items when first advanced (or told to)."""

    def __init__(self, iterator: Iterator[Any], owner: _SkipFirst) -> None:
        self.iterator = iterator
        self.owner = owner
        self.pending = True

    def advance(self) -> None:
        """Drop the items to skip now (drawing the shuffle, if it has not been drawn)."""
        if self.pending:
            for _ in range(self.owner.skip):
                next(self.iterator)
            self.owner.skip = 0
            self.pending = False

    def __iter__(self) -> _Skipping:
        return self

    def __next__(self) -> Any:
        self.advance()
        return next(self.iterator)


def replayed_epoch(loader: DataLoader[Any], epoch_start: dict[str, Any], drawn: int) -> Iterator[Any]:
    """The loader's iterator of an epoch begun with the generators at ``epoch_start``, past ``drawn`` batches.

    The data of the first ``drawn`` batches is not loaded.

    The draws happen in the unbroken run's order: the iterator's base seed as it is made, then
    the sampler's shuffle. Torch's global generator is left as it was: the checkpoint restores
    it afterwards.
    """
    now = torch.get_rng_state()
    generators = _generators(loader)
    if len(generators) != len(epoch_start["generators"]):
        raise ValueError("the data loader's samplers use other generators than the checkpoint's")
    if epoch_start["torch"] is not None:
        torch.set_rng_state(epoch_start["torch"])
    for generator, state in zip(generators, epoch_start["generators"]):
        generator.set_state(state)
    # DataLoader forbids setting its samplers after construction; its iterator reads them once,
    # as it is made, so swapping them for that moment is invisible afterwards.
    name = "batch_sampler" if loader.batch_sampler is not None else "sampler"
    original = getattr(loader, name)
    skipping = _SkipFirst(original, drawn)
    object.__setattr__(loader, name, skipping)
    try:
        iterator = iter(loader)
        if skipping.made is not None:
            skipping.made.advance()  # now, from the epoch's generators (workers may have already)
    finally:
        object.__setattr__(loader, name, original)
        torch.set_rng_state(now)
    return iterator


def warn_inexact_resume(loader: Any, epoch: int) -> None:
    """Say, once per resume, that ``loader`` cannot continue where the stopped run was."""
    name = type(loader).__name__
    if isinstance(loader, Iterator):
        what = ("the newly built iterator yields from its own beginning, which is where the stopped run was only if it "
                "draws nothing but the random generators the checkpoint restores")
    else:
        what = (f"epoch {epoch} starts over from its beginning, so batches the stopped run drew in it are "
                "drawn again and the order may differ from an unbroken run")
    warnings.warn(
        f"resuming with a data loader ({name}, from build_data_loader()) that has neither a sampler nor a saved "
        f"state: {what}; use a DataLoader over a map-style dataset or a StatefulDataLoader for an exact resume",
        InexactResumeWarning,
        stacklevel=3,
    )
