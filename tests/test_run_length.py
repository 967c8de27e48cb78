"""max_steps and max_epochs: alone, together (whichever comes first), declared as a user would."""

from __future__ import annotations

import json

import pytest
from tiny_trainer import TinyTrainer, make_data
from torch.utils.data import DataLoader

from trainloop import CheckpointingHook, TrainerSettings


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


@pytest.mark.parametrize("max_steps, max_epochs, steps, epochs", [(5, 2, 5, 0), (30, 2, 16, 2), (16, 2, 16, 2)])
def test_max_steps_and_max_epochs_whichever_comes_first(max_steps, max_epochs, steps, epochs):
    result = TinyTrainer(max_steps=max_steps, max_epochs=max_epochs).train()
    assert (result.step, result.epoch) == (steps, epochs)


def test_max_epochs_from_a_settings_file_and_the_schedule_spans_the_epochs(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"max_epochs": 3, "lr_schedule": {"name": "linear", "warmup_ratio": 0.25}}))
    trainer = TinyTrainer(TrainerSettings.from_file(path))
    result = trainer.train()
    assert result.step == 24 and trainer.max_steps == 24
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
