"""The every(n) rule, seen through every periodic hook: multiples of n and the last step of a
run that ends cleanly (max_steps, max_epochs or an exit request), never after an error."""

from __future__ import annotations

import pytest
from helper_hooks import CaptureHook, ExitAt
from tiny_trainer import TinyTrainer

from trainloop import CheckpointingHook, LoggingHook, ValidationHook
from trainloop.checkpoint.manager import checkpoint_steps
from trainloop.hook_machinery.dispatch import Every
from trainloop.hooks import Schedule


class Crash(Exception):
    pass


class CrashAt(CaptureHook):
    def __init__(self, step: int) -> None:
        super().__init__()
        self.step = step

    def on_after_step(self, trainer):
        if trainer.step == self.step:
            raise Crash


def periodic_hooks(interval: int, **validation):
    evaluated: list[int] = []
    hooks = [
        ValidationHook(lambda t: evaluated.append(t.step) or {"loss": 1.0}, interval=interval, **validation),
        LoggingHook(interval=interval),
        CheckpointingHook(interval=interval, keep_previous=100),
    ]
    return hooks, evaluated


def logged_steps(trainer) -> list[int]:
    return [row["step"] for row in trainer.metrics.history if "loss" in row and "val/loss" not in row]


@pytest.mark.parametrize(
    ("settings", "extra", "expected"),
    [
        ({"max_steps": 7}, [], [3, 6, 7]),  # max_steps not a multiple: the last step too
        ({"max_steps": 6}, [], [3, 6]),  # a multiple: once
        ({"max_steps": 20}, [ExitAt(5)], [3, 5]),  # an exit request: its last step
        ({"max_epochs": 1}, [], [3, 6, 8]),  # 64 samples / 8 per batch: 8 steps an epoch
    ],
)
def test_every_periodic_hook_acts_at_multiples_and_at_the_last_step(tmp_path, settings, extra, expected):
    hooks, evaluated = periodic_hooks(3)
    trainer = TinyTrainer(**settings, hooks=[*hooks, *extra], workspace=tmp_path)
    trainer.train()
    assert evaluated == expected
    assert logged_steps(trainer) == expected
    assert checkpoint_steps(tmp_path / "checkpoints") == expected


def test_a_run_ended_by_an_error_is_not_acted_on_at_its_end(tmp_path):
    hooks, evaluated = periodic_hooks(3)
    trainer = TinyTrainer(max_steps=20, hooks=[*hooks, CrashAt(5)], workspace=tmp_path)
    with pytest.raises(Crash):
        trainer.train()
    assert evaluated == [3]
    assert logged_steps(trainer) == [3]
    assert checkpoint_steps(tmp_path / "checkpoints") == [3]


def test_epochs_as_the_unit(tmp_path):
    # 8 steps an epoch: epochs end at steps 8, 16, 24.
    evaluated: list[int] = []
    hooks = [
        ValidationHook(lambda t: evaluated.append(t.step) or {"loss": 1.0}, interval=2, unit="epochs", at_last_step=False),
        CheckpointingHook(interval=1, unit="epochs", keep_previous=100),
    ]
    TinyTrainer(max_epochs=3, hooks=hooks, workspace=tmp_path).train()
    assert evaluated == [16]
    assert checkpoint_steps(tmp_path / "checkpoints") == [8, 16, 24]


def test_epochs_as_the_unit_with_accumulation(tmp_path):
    # 8 batches an epoch, 3 microsteps a step: each epoch's last step takes the 2 batches that
    # remain, so epochs end with steps 3, 6 and 9.
    hooks = [CheckpointingHook(interval=1, unit="epochs", keep_previous=100)]
    trainer = TinyTrainer(max_epochs=3, gradient_accumulation_steps=3, hooks=hooks, workspace=tmp_path)
    result = trainer.train()
    assert checkpoint_steps(tmp_path / "checkpoints") == [3, 6, 9]
    assert (result.step, result.epoch) == (9, 3)


def test_bad_n_is_an_error():
    with pytest.raises(ValueError, match="every=0: every is a whole number"):
        Every(Schedule(0))


def test_epochs_count_on_after_a_resume(tmp_path):
    # Run 1 saves at the end of epoch 1 (step 8) and at its exit (step 10, inside epoch 2). A
    # plain DataLoader resumes epoch 2 where it stopped (its sampler's position is saved): the
    # epoch ends at step 16, as in an unbroken run.
    def hooks(*extra):
        return [CheckpointingHook(interval=1, unit="epochs", keep_previous=100), *extra]

    TinyTrainer(max_epochs=3, hooks=hooks(ExitAt(10)), workspace=tmp_path).train()
    result = TinyTrainer(max_epochs=3, hooks=hooks(), workspace=tmp_path).train()
    assert checkpoint_steps(tmp_path / "checkpoints") == [8, 10, 16, 24]
    assert (result.step, result.epoch) == (24, 3)
