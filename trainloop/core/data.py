"""The data: batches drawn epoch after epoch, and where a plain ``DataLoader`` is in its epoch.

``EpochIterator`` draws the batches from whatever ``build_data_loader`` returned, one epoch after
another. The rest is the position, to resume exactly there on any number of ranks. A
``DataLoader`` over a map-style dataset has no state to save, but its epoch is a function of two
things: the generators its sampler shuffles with, as they were when the epoch began, and how many
batches were drawn since. ``EpochIterator`` records the first as each epoch begins; a checkpoint
saves both; a resume sets the generators back, starts the epoch again and skips the batches
already drawn *at the sampler*, so their data is never loaded (as Accelerate's
``skip_first_batches`` does). The rest of the epoch, and every later one, is then the unbroken
run's. Every epoch begins at its first draw (a resumed run's first too): its order is drawn from the
generators as they are then, so a checkpoint made between epochs needs only the loader's own
generators, and torch's is the checkpoint's.

That replay is per rank, so it needs as many ranks, each drawing batches of the same size. For a
sampler trainloop knows (``DistributedSampler``, ``RandomSampler``, ``SequentialSampler``), each
epoch also has a *global* order, the one a ``DistributedSampler`` strides over the ranks (a whole
single-process epoch otherwise), and a position in it: the samples all ranks consumed together.
On another number of ranks or another batch size, the rest of that order is dealt out as the new
loader's sampler deals an epoch (padded to, or cut to, a multiple of its ranks, as its
``drop_last`` says) and batched as the new loader batches; later epochs are the new loader's own.

What stays inexact: a loader whose workers draw random numbers (augmentation) hands the
remaining batches to its workers in another rotation than the unbroken run did; a loader with
neither a sampler nor a state (an ``IterableDataset``, a generator) cannot be positioned at all;
nor, on another number of ranks, can a sampler trainloop does not know; nor, anywhere, a dataset
whose length changed. The resume says so in a
warning.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler, RandomSampler, SequentialSampler

from trainloop.utils import warn_user

__all__ = [
    "DataExhaustedError",
    "EpochIterator",
    "InexactResumeWarning",
    "Resumed",
    "batch_size_of",
    "batches_per_epoch",
    "begun_epoch",
    "capture_epoch_start",
    "dealt_epoch",
    "describe_order",
    "epoch_order",
    "has_sampler",
    "per_draw",
    "replayed_epoch",
    "resume_in_epoch",
    "warn_inexact_resume",
]


# -- drawing batches, epoch after epoch -------------------------------------------------------


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
    it has one (``DistributedSampler`` reshuffles that way). Each epoch begins at its first
    draw, the run's first too. A one-shot iterator is drawn until it runs out, which is then an
    error.

    Args:
        loader: What ``build_data_loader`` returned.
        epoch: The epoch to start in (restored from a checkpoint).
        resumed: The loader was restored mid-run: its first epoch may be empty (it was saved
            right at the end of that epoch), and the next one then begins.
        limit: The epochs the run declares (``max_epochs``): none beyond them is begun.
        position: What :meth:`position` returned when the checkpoint was made (this rank's, or
            any rank's on another number of ranks): a ``DataLoader`` with a sampler resumes its
            epoch exactly there (see ``resume_in_epoch``), or, saved between epochs, its own
            generators get their states back before the next epoch begins.
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
        self._drawn_this_epoch = 0
        self.batches_per_epoch = batches_per_epoch(loader)
        self._epoch_length = self.batches_per_epoch  # this epoch's: a resumed epoch may have other
        self._may_be_empty = resumed
        if self._stateful or (self._sampled and position is not None and "drawn" in position):
            # Resumed mid-epoch: the epoch goes on where it was, from the generators as they were then, before the
            # checkpoint restores the generators of the moment it was saved.
            self._iterator: Iterator[Any] = self._start_epoch(position if self._sampled else None)
        else:
            # The epoch begins at its first draw, as every later one does: its order is drawn from the generators as
            # they are then (a resumed run's: the checkpoint's), whatever drew from them before.
            if self._sampled and position is not None:
                _set_generators(loader, position["generators"])  # type: ignore[arg-type]  # sampled: a DataLoader
            self._iterator = _EpochToBegin(self)
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
            self._epoch_start = capture_epoch_start(loader, self.epoch)
            self._order = describe_order(loader, self._epoch_start)
            return begun_epoch(loader, self._epoch_start)
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

        Mid-epoch, for a resume on as many ranks with the same batch size: the generators' states as the epoch began
        (``epoch_start``; ``None`` in an epoch dealt out on resume) and the batches drawn since (``drawn``), with the
        batch size. For any other resume, when the sampler is one trainloop knows: how the epoch's global order is made
        (``order``) and how many of its indices all ranks consumed (``consumed``). The dataset's length with either.

        Between epochs (before an epoch's first batch, or after its last): the states of the loader's and its
        sampler's own generators (``generators``), which the next epoch's order is drawn from; torch's global one is
        the checkpoint's. ``None`` for other loaders, and between epochs for a loader without generators of its own.
        An epoch whose last batch is drawn is run out first: a sampler may draw as it ends (a ``RandomSampler`` draws
        one permutation more from its generator), which the unbroken run does before the next epoch's order.
        """
        if not self._sampled:
            return None
        if not self._mid_epoch():
            self._run_out()
            generators = _generators(self.loader)  # type: ignore[arg-type]  # sampled: a DataLoader
            return {"generators": [g.get_state() for g in generators]} if generators else None
        step = per_draw(self.loader) if self._order is not None else None
        drawn = self._drawn_this_epoch
        return {
            "epoch_start": self._epoch_start,
            "drawn": drawn,
            "batch_size": batch_size_of(self.loader),
            "order": self._order,
            "consumed": None if step is None else self._consumed_before + drawn * step,
            "dataset_length": _dataset_items(self.loader),
        }

    def _run_out(self) -> None:
        """Run the current epoch's iterator out, if all its batches are drawn: the next draw begins the next epoch."""
        length = self._epoch_length
        if length is None or self._drawn_this_epoch < length or isinstance(self._iterator, _EpochToBegin):
            return
        try:
            batch = next(self._iterator)
        except StopIteration:
            self._iterator = iter(())
        else:  # more batches than the loader's length said: they are drawn as they come
            self._iterator = itertools.chain([batch], self._iterator)

    def _mid_epoch(self) -> bool:
        """Whether some batches of the current epoch are drawn, and not all."""
        length, drawn = self._epoch_length, self._drawn_this_epoch
        if drawn == 0 and self._consumed_before == 0:
            return False
        return length is None or drawn < length

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
        return self.epoch if self._stateful or (self._sampled and self._mid_epoch()) else self.epochs_completed

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
        if self.owner._iterator is self:  # else the draw began an epoch, whose iterator is in place
            self.owner._iterator = self.iterator
        self.fn(batch)
        return batch


class _EpochToBegin:
    """The iterator of an epoch not begun yet: its first draw begins it, then draws from the epoch's own iterator."""

    def __init__(self, owner: EpochIterator) -> None:
        self.owner = owner

    def __iter__(self) -> _EpochToBegin:
        return self

    def __next__(self) -> Any:
        owner = self.owner
        owner._iterator = owner._start_epoch()
        return next(owner._iterator)


# -- the position in an epoch, and resuming there ---------------------------------------------


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


def batch_size_of(loader: Any) -> int | None:
    """The samples in each batch a ``DataLoader`` draws (its batch sampler's), or ``None`` when it does not say."""
    if not isinstance(loader, DataLoader):
        return None
    size = loader.batch_size if loader.batch_size is not None else getattr(loader.batch_sampler, "batch_size", None)
    return size if isinstance(size, int) else None


def _known_sampler(loader: Any) -> Any:
    """The sampler whose order a loader batches, if trainloop knows how that order is made and dealt; else ``None``.

    Only torch's own ``BatchSampler`` (or none) over a ``DistributedSampler``, ``RandomSampler`` or
    ``SequentialSampler``: a subclass may order or deal otherwise.
    """
    if not has_sampler(loader):
        return None
    batch_sampler = loader.batch_sampler
    if batch_sampler is not None and type(batch_sampler) is not BatchSampler:
        return None
    sampler = loader.sampler if batch_sampler is None else batch_sampler.sampler
    return sampler if type(sampler) in (DistributedSampler, RandomSampler, SequentialSampler) else None


def _dataset_length(sampler: Any) -> int:
    data: Any = sampler.dataset if isinstance(sampler, DistributedSampler) else sampler.data_source
    return len(data)


class _Indices(Dataset[int]):
    """A stand-in map-style dataset of ``length`` items, item ``i`` being ``i``: what torch's samplers order."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> int:
        return index


def _sharing(sampler: Any) -> tuple[int, int, bool]:
    """How a sampler shares an epoch among ranks: their number, this one's, whether it cuts (else pads) the order."""
    if isinstance(sampler, DistributedSampler):
        return sampler.num_replicas, sampler.rank, sampler.drop_last
    return 1, 0, False


def per_draw(loader: Any) -> int | None:
    """The indices of the global order that one batch drawn on every rank consumes, for a loader with a known sampler.

    ``None`` for any other loader.
    """
    sampler = _known_sampler(loader)
    if sampler is None:
        return None
    size = batch_size_of(loader) if loader.batch_sampler is not None else 1
    return None if size is None else size * _sharing(sampler)[0]


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


def _set_generators(loader: DataLoader[Any], states: list[torch.Tensor]) -> None:
    """Give the loader's own generators (:func:`_generators`) the states ``states`` lists, if it lists as many."""
    generators = _generators(loader)
    if len(generators) == len(states):
        for generator, state in zip(generators, states, strict=True):
            generator.set_state(state)


def _dataset_items(loader: Any) -> int | None:
    """The length of a ``DataLoader``'s dataset, or ``None`` when it has none."""
    try:
        return len(loader.dataset)
    except TypeError:
        return None


def _seeds_workers(loader: DataLoader[Any], epoch: int) -> bool:
    """Whether ``iter(loader)`` draws its workers' base seed as ``epoch`` begins, before the epoch's order.

    Every epoch does, but with persistent workers, whose iterator is made once and reset by later epochs: then only
    the first epoch (0) does, in a resumed run too, which makes its iterator as an unbroken run would reset it.
    """
    return not (loader.persistent_workers and loader.num_workers > 0 and epoch > 0)


def capture_epoch_start(loader: DataLoader[Any], epoch: int = 0) -> dict[str, Any]:
    """The generator states an epoch's shuffle is drawn from, taken just before ``iter(loader)``.

    Torch's global one (5 KB) is included only when the order may come from it. ``seeds_workers`` says whether
    ``iter(loader)`` draws the workers' base seed before the order (see :func:`_seeds_workers`).
    """
    return {
        "torch": torch.get_rng_state() if _draws_from_torch(loader) else None,
        "generators": [g.get_state() for g in _generators(loader)],
        "seeds_workers": _seeds_workers(loader, epoch),
    }


def begun_epoch(loader: DataLoader[Any], epoch_start: dict[str, Any]) -> Iterator[Any]:
    """The loader's iterator of the epoch that begins now, from the generators :func:`capture_epoch_start` found.

    Where the epoch draws no base seed for its workers (persistent ones) but the loader has no iterator to reset yet
    (a resumed run), the one made now draws its base seed, and the generators are given back their states before the
    order is drawn: the order and every later draw are the unbroken run's.
    """
    if epoch_start["seeds_workers"] or loader._iterator is not None:
        return iter(loader)
    start = {"torch": torch.get_rng_state(), "generators": epoch_start["generators"]}
    with _index_sampler_swapped(loader, _SkipFirst, 0, lambda: _set_epoch_start(loader, start)):
        return iter(loader)


def describe_order(loader: Any, epoch_start: dict[str, Any]) -> dict[str, Any] | None:
    """How the global order of the epoch that begins now is made, for :func:`epoch_order`; ``None`` if unknown.

    Called after ``set_epoch`` and :func:`capture_epoch_start`, before ``iter(loader)``. A ``DistributedSampler``'s
    order is its permutation (or range) before it is strided over the ranks; a single-process sampler's, all it yields.
    A ``RandomSampler``'s is kept as the generator states it is drawn from, and which of the loader and the sampler
    hold a generator of their own.
    """
    sampler = _known_sampler(loader)
    if sampler is None:
        return None
    length = _dataset_length(sampler)
    if isinstance(sampler, DistributedSampler):
        return {"kind": "distributed", "length": length, "shuffle": sampler.shuffle, "seed": sampler.seed,
                "epoch": sampler.epoch}
    if isinstance(sampler, SequentialSampler):
        return {"kind": "sequential", "length": length}
    own = sampler.generator
    return {
        "kind": "random", "length": length, "replacement": sampler.replacement, "num_samples": sampler.num_samples,
        "loader_generator": loader.generator is not None,
        "sampler_generator": None if own is None else "loader" if own is loader.generator else "own",
        "epoch_start": epoch_start,
    }


def epoch_order(order: dict[str, Any]) -> list[int]:
    """The dataset indices of an epoch in its global order, made again from what :func:`describe_order` returned.

    Made by torch's own samplers: a one-rank ``DistributedSampler`` with the same seed and epoch; a ``RandomSampler``
    in a stand-in ``DataLoader`` of the same shape, from the generator states the epoch began with.
    """
    length = order["length"]
    if order["kind"] == "sequential":
        return list(range(length))
    if order["kind"] == "distributed":
        sampler: DistributedSampler[int] = DistributedSampler(
            _Indices(length), num_replicas=1, rank=0, shuffle=order["shuffle"], seed=order["seed"], drop_last=False
        )
        sampler.set_epoch(order["epoch"])
        return list(sampler)
    loader_generator = torch.Generator() if order["loader_generator"] else None
    shared = {"loader": loader_generator, "own": torch.Generator(), None: None}[order["sampler_generator"]]
    stand_in = DataLoader(
        _Indices(length), batch_size=None, generator=loader_generator,
        sampler=RandomSampler(_Indices(length), replacement=order["replacement"], num_samples=order["num_samples"],
                              generator=shared),
    )
    epoch_start = order["epoch_start"]
    with _epoch_generators(stand_in, epoch_start):
        # Its base seed first, as the epoch's loader drew it (or none: the generators are set again before the order).
        with _index_sampler_swapped(stand_in, _SkipFirst, 0, _restart(stand_in, epoch_start)) as recorded:
            iter(stand_in)
        return list(recorded.last)


def _set_epoch_start(loader: DataLoader[Any], epoch_start: dict[str, Any]) -> None:
    """Set torch's global generator (unless ``epoch_start`` left it out) and the loader's own to ``epoch_start``."""
    generators = _generators(loader)
    if len(generators) != len(epoch_start["generators"]):
        raise ValueError("the data loader's samplers use other generators than the checkpoint's")
    if epoch_start["torch"] is not None:
        torch.set_rng_state(epoch_start["torch"])
    for generator, state in zip(generators, epoch_start["generators"], strict=True):
        generator.set_state(state)


@contextlib.contextmanager
def _epoch_generators(loader: DataLoader[Any], epoch_start: dict[str, Any]) -> Iterator[None]:
    """Set the loader's generators to ``epoch_start``; torch's global one is given back its state afterwards."""
    now = torch.get_rng_state()
    _set_epoch_start(loader, epoch_start)
    try:
        yield
    finally:
        torch.set_rng_state(now)


@contextlib.contextmanager
def _index_sampler_swapped(loader: DataLoader[Any], make: Any, *args: Any) -> Iterator[Any]:
    """Put ``make(index_sampler, *args)`` in place of the loader's index sampler while the block makes an iterator.

    ``DataLoader`` forbids setting its samplers after construction; its iterator reads them once, as it is made (a
    multi-worker one iterates them twice as it starts), so swapping them for that moment is invisible afterwards.
    Persistent workers keep iterating the stand-in in later epochs: it then gives the original's iterators.
    """
    name = "batch_sampler" if loader.batch_sampler is not None else "sampler"
    original = getattr(loader, name)
    stand_in = make(original, *args)
    object.__setattr__(loader, name, stand_in)
    try:
        yield stand_in
    finally:
        object.__setattr__(loader, name, original)
        stand_in.settle()


class _StandIn:
    """An index sampler in place of ``original`` while an iterator is made; the original itself afterwards."""

    def __init__(self, original: Any) -> None:
        self.original = original
        self.active = True

    def __len__(self) -> int:
        return len(self.original)

    def __iter__(self) -> Iterator[Any]:
        return self.made_iterator() if self.active else iter(self.original)

    def made_iterator(self) -> Iterator[Any]:
        raise NotImplementedError

    def settle(self) -> None:
        """The iterator is made: later iterations are the original's."""
        self.active = False


class _SkipFirst(_StandIn):
    """The original's iterators, each dropping the first ``skip`` items as it is first advanced.

    A multi-worker ``DataLoader`` makes two as it starts, and draws from the second at once. The one made last is
    advanced past the skipped items as the iterator is made, from the epoch's generators, if it was not yet. Each
    calls ``restart`` first, if given (see :func:`_restart`).
    """

    def __init__(self, original: Any, skip: int, restart: Callable[[], None] | None = None) -> None:
        super().__init__(original)
        self.skip = skip
        self.restart = restart
        self.last: _Skipping | None = None

    def made_iterator(self) -> Iterator[Any]:
        self.last = _Skipping(iter(self.original), self.skip, self.restart)
        return self.last

    def settle(self) -> None:
        super().settle()
        if self.last is not None:
            self.last.advance()


def _restart(loader: DataLoader[Any], epoch_start: dict[str, Any]) -> Callable[[], None] | None:
    """What sets the generators to ``epoch_start`` again as the order is first drawn; ``None`` where it needs not.

    Only an epoch that drew no base seed before its order needs it (persistent workers, see :func:`_seeds_workers`):
    replaying such an epoch on a new iterator, its base seed is drawn first: the order must not be drawn after it.
    """
    if epoch_start.get("seeds_workers", True):
        return None
    return lambda: _set_epoch_start(loader, epoch_start)


class _Skipping:
    """An iterator that drops its first ``skip`` items when first advanced (or told to), ``restart()`` called first."""

    def __init__(self, iterator: Iterator[Any], skip: int, restart: Callable[[], None] | None = None) -> None:
        self.iterator = iterator
        self.skip = skip
        self.restart = restart

    def advance(self) -> None:
        """Drop the items to skip now, if not yet (drawing the shuffle, if it has not been drawn)."""
        if self.restart is not None:
            restart, self.restart = self.restart, None
            restart()
        for _ in range(self.skip):
            next(self.iterator)
        self.skip = 0

    def __iter__(self) -> _Skipping:
        return self

    def __next__(self) -> Any:
        self.advance()
        return next(self.iterator)


class _Dealt(_StandIn):
    """Gives the indices (or batches of them) dealt to this rank, in place of what the original would."""

    def __init__(self, original: Any, dealt: list[Any]) -> None:
        super().__init__(original)
        self.dealt = dealt

    def made_iterator(self) -> Iterator[Any]:
        return iter(self.dealt)


def replayed_epoch(loader: DataLoader[Any], epoch_start: dict[str, Any], drawn: int) -> Iterator[Any]:
    """The loader's iterator of an epoch begun with the generators at ``epoch_start``, past ``drawn`` batches.

    The data of the first ``drawn`` batches is not loaded.

    The draws happen in the unbroken run's order: the iterator's base seed as it is made, then
    the sampler's shuffle. Torch's global generator is left as it was: the checkpoint restores
    it afterwards.
    """
    restart = _restart(loader, epoch_start)
    if drawn == 0 and restart is None:
        with _epoch_generators(loader, epoch_start):
            return iter(loader)
    # The skipping happens as the stand-in settles, inside the epoch's generators.
    with _epoch_generators(loader, epoch_start), _index_sampler_swapped(loader, _SkipFirst, drawn, restart):
        return iter(loader)


def dealt_epoch(loader: DataLoader[Any], order: list[int], consumed: int) -> tuple[Iterator[Any], int]:
    """The loader's iterator over the rest of an epoch's global ``order``, past its first ``consumed`` indices.

    The rest is dealt as the loader's sampler deals a whole epoch (a ``DistributedSampler`` pads it with its first
    indices, or cuts it, to a multiple of its ranks, then strides it; others take it all), and batched as the loader
    batches. Returns the iterator and the number of batches it yields.
    """
    sampler = _known_sampler(loader)
    rest = order[consumed:]
    replicas, rank, cut = _sharing(sampler)
    dealing: DistributedSampler[int] = DistributedSampler(
        _Indices(len(rest)), num_replicas=replicas, rank=rank, shuffle=False, drop_last=cut
    )
    mine = [rest[i] for i in dealing] if rest else []
    dealt: list[Any] = mine
    batch_sampler: Any = loader.batch_sampler
    if batch_sampler is not None:
        dealt = list(BatchSampler(mine, batch_size=batch_sampler.batch_size, drop_last=batch_sampler.drop_last))
    with _index_sampler_swapped(loader, _Dealt, dealt):
        return iter(loader), len(dealt)


@dataclass
class Resumed:
    """An epoch resumed where a checkpoint's position says, as :func:`resume_in_epoch` found it.

    Attributes:
        iterator: The loader's iterator over the rest of the epoch.
        epoch_start: The generator states a per-rank replay of this epoch needs (``None`` once the epoch was dealt).
        order: How the epoch's global order is made (``None`` for a sampler trainloop does not know).
        consumed: The indices of that order consumed before ``iterator``'s first batch.
        drawn: The batches of this epoch counted as drawn before ``iterator``'s first one.
        length: The batches of this epoch on this rank, ``drawn`` included (``None``: the loader's length).
    """

    iterator: Iterator[Any]
    epoch_start: dict[str, Any] | None
    order: dict[str, Any] | None
    consumed: int
    drawn: int
    length: int | None


def resume_in_epoch(loader: DataLoader[Any], position: dict[str, Any], epoch: int) -> Resumed | None:
    """Resume the loader's epoch where ``position`` (what a checkpoint saved) says, exactly; or ``None`` and a warning.

    A dataset of another length starts the epoch over. The same batch size on as many ranks (a ``position`` with its
    ``epoch_start``) replays this rank's epoch. Any other change deals the rest of the epoch's global order out, when
    both samplers are ones trainloop knows. Otherwise the warning says that the epoch starts over.
    """
    order = position.get("order")
    then = position.get("dataset_length", None if order is None else order["length"])
    now = _dataset_items(loader)
    if then is not None and now is not None and now != then:
        _warn(f"the dataset has {now} items and the checkpoint's epoch had {then}", epoch)
        return None
    size = batch_size_of(loader)
    if position.get("epoch_start") is not None and position.get("batch_size", size) == size:
        start = position["epoch_start"]
        iterator = replayed_epoch(loader, start, position["drawn"])
        return Resumed(iterator, start, position.get("order"), 0, position["drawn"], None)
    sampler = _known_sampler(loader)
    if order is None or sampler is None or per_draw(loader) is None:
        unknown = "the checkpoint's" if order is None else f"this run's ({_sampler_name(loader)})"
        _warn(f"the data loader's position cannot be carried to other ranks or another batch size: {unknown} sampler "
              "is not a DistributedSampler, RandomSampler or SequentialSampler batched by torch's BatchSampler", epoch)
        return None
    iterator, length = dealt_epoch(loader, epoch_order(order), position["consumed"])
    return Resumed(iterator, None, order, position["consumed"], 0, length)


def _sampler_name(loader: DataLoader[Any]) -> str:
    batch_sampler = loader.batch_sampler
    if batch_sampler is not None and type(batch_sampler) is not BatchSampler:
        return type(batch_sampler).__name__
    return type(loader.sampler if batch_sampler is None else batch_sampler.sampler).__name__


def _warn(why: str, epoch: int) -> None:
    warn_user(
        f"resuming mid-epoch inexactly: {why}; epoch {epoch} starts over from its beginning, so batches the stopped "
        "run drew in it are drawn again",
        InexactResumeWarning,
    )


def warn_inexact_resume(loader: Any, epoch: int) -> None:
    """Say, once per resume, that ``loader`` cannot continue where the stopped run was."""
    name = type(loader).__name__
    if isinstance(loader, Iterator):
        what = ("the newly built iterator yields from its own beginning, which is where the stopped run was only if it "
                "draws nothing but the random generators the checkpoint restores")
    else:
        what = (f"epoch {epoch} starts over from its beginning, so batches the stopped run drew in it are "
                "drawn again and the order may differ from an unbroken run")
    warn_user(
        f"resuming with a data loader ({name}, from build_data_loader()) that has neither a sampler nor a saved "
        f"state: {what}; use a DataLoader over a map-style dataset or a StatefulDataLoader for an exact resume",
        InexactResumeWarning,
    )
