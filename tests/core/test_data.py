import pytest

from trainloop.core.data import DataExhaustedError, EpochIterator


class Loader(list):
    """A re-iterable with set_epoch, like a DataLoader over a DistributedSampler."""

    def __init__(self, items):
        super().__init__(items)
        self.epochs = []

    def set_epoch(self, epoch):
        self.epochs.append(epoch)


def take(iterator, n):
    return [next(iterator) for _ in range(n)]


def test_reiterables_run_epoch_after_epoch():
    loader = Loader([1, 2, 3])
    batches = EpochIterator(loader)
    assert take(batches, 7) == [1, 2, 3, 1, 2, 3, 1]
    assert batches.epoch == 2
    assert loader.epochs == [0, 1, 2]


def test_a_restored_epoch_is_passed_to_set_epoch():
    loader = Loader([1])
    batches = EpochIterator(loader, epoch=5)
    take(batches, 2)
    assert loader.epochs == [5, 6]


def test_one_shot_iterators_are_drawn_once():
    batches = EpochIterator(iter([1, 2]))
    assert take(batches, 2) == [1, 2]
    with pytest.raises(DataExhaustedError, match="ran out after 2 batches"):
        next(batches)


def test_a_loader_that_empties_later_is_an_error():
    class Shrinking:
        def __init__(self):
            self.rounds = [[1], []]

        def __iter__(self):
            return iter(self.rounds.pop(0))

    batches = EpochIterator(Shrinking())
    assert next(batches) == 1
    with pytest.raises(DataExhaustedError, match="yielded no batch in epoch 1"):
        next(batches)


def test_close_closes_the_current_iterator():
    closed = []

    def gen():
        try:
            yield 1
            yield 2
        finally:
            closed.append(True)

    batches = EpochIterator(gen())
    next(batches)
    batches.close()
    assert closed == [True]


def test_a_resumed_loader_may_start_with_an_empty_epoch():
    class Restored(Loader):
        """Saved right at an epoch's end: its first iteration is empty."""

        def __init__(self, items):
            super().__init__(items)
            self.first = True

        def __iter__(self):
            if self.first:
                self.first = False
                return iter([])
            return super().__iter__()

    batches = EpochIterator(Restored([1, 2]), epoch=4, resumed=True)
    assert take(batches, 3) == [1, 2, 1]
    assert batches.epoch == 6
    with pytest.raises(DataExhaustedError, match="yielded no batch in epoch 0"):
        next(EpochIterator(Restored([1, 2])))
