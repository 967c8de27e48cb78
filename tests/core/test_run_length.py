"""max_steps and max_epochs: alone, together (whichever comes first), declared as a user would."""

from __future__ import annotations

import json

import pytest
import torch
from helper_hooks import CaptureHook
from tiny_trainer import TinyTrainer, make_data
from torch.utils.data import DataLoader

from trainloop import CheckpointingHook, DataExhaustedError, TrainerSettings


class Counter:
    """Counts the batches drawn from a loader, per epoch."""

    def __init__(self, loader):
        self.loader, self.epochs = loader, []

    def __iter__(self):
        self.epochs.append(0)
        for batch in self.loader:
            self.epochs[-1] += 1
            yield batch

    def __len__(self):
        return len(self.loader)


def test_max_epochs_alone_runs_whole_passes_over_the_data():
    data = Counter(DataLoader(make_data(), batch_size=8))  # 8 batches an epoch
    trainer = TinyTrainer(max_epochs=2, data=data)
    result = trainer.train()
    assert data.epochs == [8, 8]
    assert (result.step, result.epoch, trainer.max_steps) == (16, 2, 16)


@pytest.mark.parametrize(("max_steps", "max_epochs", "steps", "epochs"), [(5, 2, 5, 0), (30, 2, 16, 2), (16, 2, 16, 2)])
def test_max_steps_and_max_epochs_whichever_comes_first(max_steps, max_epochs, steps, epochs):
    result = TinyTrainer(max_steps=max_steps, max_epochs=max_epochs).train()
    assert (result.step, result.epoch) == (steps, epochs)


def test_max_epochs_from_a_settings_file_and_the_schedule_spans_the_epochs(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"max_epochs": 3, "lr_schedule": {"name": "linear", "warmup_ratio": 0.25}}))
    trainer = TinyTrainer(TrainerSettings.from_file(path))
    result = trainer.train()
    assert result.step == 24
    assert trainer.max_steps == 24
    # A linear decay over the 24 planned steps ends at zero.
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-12)


def test_max_epochs_resumes_counting_epochs(tmp_path):
    TinyTrainer(max_epochs=1, workspace=tmp_path, hooks=[CheckpointingHook(interval=100)]).train()
    result = TinyTrainer(max_epochs=2, workspace=tmp_path, hooks=[CheckpointingHook(interval=100)]).train()
    assert (result.step, result.epoch) == (16, 2)


def test_max_epochs_needs_a_loader_with_a_length():
    endless = iter([])
    with pytest.raises(ValueError, match=r"max_epochs=2 needs a data loader with a length.*list_iterator.*set max_steps"):
        TinyTrainer(max_epochs=2, data=endless).train()


# -- max_epochs trains exactly the declared epochs, whatever the accumulation ------------------


def epoch_of(batches: int) -> Counter:
    return Counter(DataLoader(make_data(8 * batches), batch_size=8))


@pytest.mark.parametrize(
    ("batches", "accumulation", "max_epochs", "steps"),
    [(4, 8, 1, 1), (5, 2, 1, 3), (4, 10**6, 1, 1), (5, 2, 3, 9), (8, 3, 2, 6)],
)
def test_each_batch_of_each_declared_epoch_is_drawn_once(batches, accumulation, max_epochs, steps):
    data = epoch_of(batches)
    trainer = TinyTrainer(max_epochs=max_epochs, gradient_accumulation_steps=accumulation, data=data, trace=True)
    result = trainer.train()
    assert data.epochs == [batches] * max_epochs
    assert (result.step, result.epoch, trainer.max_steps) == (steps, max_epochs, steps)
    updates = sum(1 for e in trainer.trace if e.trigger == "update")
    assert updates == steps


def test_an_epochs_last_step_is_normalised_by_what_it_accumulated():
    # 5 batches with accumulation 2: updates on (b0, b1), (b2, b3) and b4 alone, each on the mean
    # loss of what it accumulated: the same as 3 updates on those batches joined.
    batches = list(DataLoader(make_data(40), batch_size=8))
    joined = [
        tuple(torch.cat(parts) for parts in zip(*group, strict=True))
        for group in (batches[0:2], batches[2:4], batches[4:5])
    ]
    accumulated = TinyTrainer(max_epochs=1, gradient_accumulation_steps=2, data=batches)
    reference = TinyTrainer(max_epochs=1, data=joined)
    accumulated.train(), reference.train()
    for a, b in zip(accumulated.model.parameters(), reference.model.parameters(), strict=True):
        torch.testing.assert_close(a, b)


class SkipsLast(TinyTrainer):
    """Returns loss=None for the last batch of every epoch (8 items a batch, 4 a epoch)."""

    def forward(self, batch):
        self.drawn = getattr(self, "drawn", 0) + 1
        return (None, None) if self.drawn % 4 == 0 else super().forward(batch)


def test_a_step_whose_epoch_runs_out_while_skipping_ends_on_what_it_has():
    # Accumulation 4 over 4 batches whose last returns None: each epoch's step has 3 microsteps,
    # normalised by 3, and the next epoch is never touched by it.
    data = epoch_of(4)
    trainer = SkipsLast(max_epochs=2, gradient_accumulation_steps=4, data=data)
    result = trainer.train()
    assert data.epochs == [4, 4]
    assert result.step == 2
    first_three = torch.utils.data.Subset(make_data(32), range(24))
    reference = TinyTrainer(max_epochs=2, data=DataLoader(first_three, batch_size=24))
    reference.train()
    for a, b in zip(trainer.model.parameters(), reference.model.parameters(), strict=True):
        torch.testing.assert_close(a, b)


def test_an_empty_loader_under_max_epochs_is_a_clear_error():
    hook = CaptureHook()
    with pytest.raises(DataExhaustedError, match=r"max_epochs=1, but the data loader .* has no batch"):
        TinyTrainer(max_epochs=1, data=[], hooks=[hook]).train()
    assert hook.calls == []  # refused while building


def test_max_epochs_with_every_loss_none_ends_with_a_clear_error():
    class AllNone(TinyTrainer):
        def forward(self, batch):
            return None, None

    data = epoch_of(4)
    with pytest.raises(DataExhaustedError, match=r"AllNone.forward\(\) returned loss=None .*max_epochs=1"):
        AllNone(max_epochs=1, data=data).train()
    assert data.epochs == [4]  # nothing beyond the declared epoch was drawn



def sequential_batches(dataset):
    return DataLoader(dataset, batch_size=4)  # 6 batches of 4 an epoch: items 0-3, 4-7, ..., 20-23


def skipping(accumulation, skip, max_epochs=3):
    """A run over ``sequential_batches`` whose forward skips the batches holding an item of ``skip``."""
    from epoch_trainer import SampleTrainer

    return SampleTrainer(max_epochs=max_epochs, gradient_accumulation_steps=accumulation, skip=frozenset(skip),
                         loader=sequential_batches)


def kept_items(skip):
    return [i for i in range(24) if not skip.intersection(range(i - i % 4, i - i % 4 + 4))]


@pytest.mark.parametrize(
    ("accumulation", "skip", "per_epoch"),
    [
        (3, {12}, 2),  # batches 1-3; then 4 (skipped), 5 and 6 end the epoch: the step updates on two
        (3, {4, 16}, 2),  # batches 1, 2 (skipped), 3 and 4; then 5 (skipped) and 6 end the epoch
        (2, {16}, 3),  # batches 1-2, 3-4; then 5 (skipped) and 6 end the epoch
    ],
)
def test_a_step_never_draws_from_the_epoch_after_its_own_while_forward_skips_batches(accumulation, skip, per_epoch):
    trainer = skipping(accumulation, skip)
    result = trainer.train()  # ends cleanly: not "the 3 epoch(s) of max_epochs=3 are all drawn"
    assert (result.step, result.epoch, result.exit_code) == (3 * per_epoch, 3, 0)
    for epoch in range(3):  # each epoch's steps train on its batches, once, in order: no step spans two epochs
        steps = range(epoch * per_epoch + 1, (epoch + 1) * per_epoch + 1)
        assert [i for step in steps for i in trainer.samples[step]] == kept_items(skip)


def test_a_step_that_skipped_every_batch_left_in_its_epoch_goes_on_in_the_next_but_not_past_the_last():
    # Batches 5 and 6 skipped, accumulation 2: each epoch's third step has nothing when its epoch runs out, so it
    # trains on the next epoch's first two batches; in the last epoch there is none, which is the documented error.
    trainer = skipping(2, {16, 20})
    with pytest.raises(DataExhaustedError, match=r"returned loss=None for every batch of the last epoch's step"):
        trainer.train()
    assert [trainer.samples[s] for s in range(1, 7)] == [
        [0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15], [0, 1, 2, 3, 4, 5, 6, 7],  # step 3 spans epochs 0-1
        [8, 9, 10, 11, 12, 13, 14, 15], [0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15],
    ]
    assert trainer.step == 7  # the step that found nothing in the last epoch
