"""A run stopped at an epoch's boundary (or beside it) resumes as the unbroken run: the same samples at every step,
weights and optimizer state ``torch.equal``.

Every trainer has dropout, so a resume whose global generator is one draw behind ends with other weights even when
it draws the same samples. 24 items in batches of 4: 6 batches an epoch.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from epoch_trainer import Indexed, SampleTrainer, compare, ended, run, shuffled
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

from trainloop.core.data import InexactResumeWarning
from trainloop.hooks.checkpointing import CheckpointingHook


def own_generator(dataset):
    return DataLoader(dataset, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(11))


def sampler_generator(dataset):
    sampler = RandomSampler(dataset, generator=torch.Generator().manual_seed(11))
    return DataLoader(dataset, batch_size=4, sampler=sampler)


def sequential(dataset):
    return DataLoader(dataset, batch_size=4)


def distributed(dataset):
    return DataLoader(dataset, batch_size=4, sampler=DistributedSampler(dataset, num_replicas=1, rank=0, seed=3))


def persistent_worker(dataset):
    return DataLoader(dataset, batch_size=4, shuffle=True, num_workers=1, persistent_workers=True)


LOADERS = {
    "shuffled": shuffled,
    "loader-generator": own_generator,
    "sampler-generator": sampler_generator,
    "sequential": sequential,
    "distributed": distributed,
}


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "settings differ": max_steps, max_epochs
        yield


@pytest.mark.parametrize("loader", list(LOADERS))
@pytest.mark.parametrize("stop", [6, 7, 12], ids=lambda s: f"stop{s}")
def test_a_run_stopped_at_or_beside_an_epoch_boundary_resumes_as_the_unbroken_run(tmp_path, loader, stop):
    unbroken, resumed = compare(tmp_path, {"max_steps": stop}, {"max_steps": 15}, loader=LOADERS[loader])
    assert len(unbroken.samples) == 15
    resumed.assert_same_as(unbroken)


@pytest.mark.parametrize("loader", ["shuffled", "loader-generator", "distributed"])
def test_a_save_every_epoch_with_max_epochs_resumes_as_the_unbroken_run(tmp_path, loader):
    unbroken, resumed = compare(
        tmp_path, {"max_epochs": 1}, {"max_epochs": 3}, loader=LOADERS[loader],
        save=lambda: CheckpointingHook(interval=1, unit="epochs", keep_previous=100),
    )
    assert sorted(unbroken.samples) == list(range(1, 19))
    resumed.assert_same_as(unbroken)


def test_a_loader_with_its_own_generator_does_not_repeat_the_first_epochs_order_after_a_resume(tmp_path):
    first = run(tmp_path, [CheckpointingHook(interval=6)], max_steps=6, loader=own_generator)
    second = run(tmp_path, [CheckpointingHook(interval=100)], max_steps=12, loader=own_generator)
    epoch_one = [first.samples[s] for s in range(1, 7)]
    epoch_two = [second.samples[s] for s in range(7, 13)]
    assert epoch_one != epoch_two


def test_persistent_workers_stopped_at_the_first_step_of_epoch_two_resume_with_the_unbroken_runs_samples(tmp_path):
    unbroken, resumed = compare(tmp_path, {"max_steps": 7}, {"max_steps": 13}, loader=persistent_worker)
    resumed.assert_same_as(unbroken)


def test_persistent_workers_stopped_at_an_epoch_boundary_resume_with_the_unbroken_runs_samples(tmp_path):
    unbroken, resumed = compare(tmp_path, {"max_steps": 6}, {"max_steps": 13}, loader=persistent_worker)
    resumed.assert_same_as(unbroken)


def test_a_dataset_of_another_length_on_as_many_ranks_warns_that_the_epoch_starts_over(tmp_path):
    run(tmp_path, [CheckpointingHook(interval=3)], max_steps=3)
    with pytest.warns(InexactResumeWarning, match="the dataset has 28 items and the checkpoint's epoch had 24"):
        second = run(tmp_path, [CheckpointingHook(interval=100)], max_steps=5, items=28)
    assert sorted(second.samples) == [4, 5]


def test_a_resume_from_a_mid_epoch_save_with_the_same_dataset_does_not_warn(tmp_path):
    run(tmp_path, [CheckpointingHook(interval=3)], max_steps=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", InexactResumeWarning)
        run(tmp_path, [CheckpointingHook(interval=100)], max_steps=5)


def test_the_samples_and_state_of_an_unbroken_run_do_not_depend_on_saving(tmp_path):
    plain = ended(run(max_steps=13))
    saving = ended(run(tmp_path, [CheckpointingHook(interval=1)], max_steps=13))
    saving.assert_same_as(plain)


def test_epoch_trainer_samples_cover_each_epoch_once():
    trainer = SampleTrainer(max_epochs=2)
    trainer.train()
    steps = [trainer.samples[s] for s in range(1, 13)]
    assert sorted(i for step in steps[:6] for i in step) == list(range(len(Indexed())))
    assert sorted(i for step in steps[6:] for i in step) == list(range(len(Indexed())))
