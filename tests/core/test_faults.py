"""Faults mid-run: a NaN storm, a forward that returns the wrong thing, records that are not
numbers, data that runs out. Each ends with a clear error that names what was wrong, no
optimizer step on bad gradients or a half-done step, and the last checkpoint intact: it still
loads, ``latest`` still points at it, nothing else was written, and a run resumes from it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_trainer import TinyTrainer, make_data
from torch.utils.data import DataLoader

from trainloop import BaseHook, DataExhaustedError, Loss, State
from trainloop.checkpoint import checkpoint_steps, latest_checkpoint, read_checkpoint
from trainloop.hooks.checkpointing import CheckpointingHook
from trainloop.hooks.logging_hook import LoggingHook
from trainloop.hooks.stats import StatsHook
from trainloop.utils import key_average

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")

INTERVAL = 2
GOOD_STEPS = 4  # steps 1-4 are good, checkpointed at 2 and 4 (only 4 is kept); step 5 goes bad
BAD_FROM = GOOD_STEPS + 1
Output = Callable[[torch.Tensor, dict[str, Any], Any], Any]


# -- helpers ---------------------------------------------------------------------------------


class FaultTrainer(TinyTrainer):
    """TinyTrainer with momentum (optimizer state to keep intact) whose ``forward`` returns
    ``bad(loss, records, batch)`` from step ``bad_from`` on, and counts its calls per step."""

    def __init__(self, *args: Any, bad: Output | None = None, bad_from: int = BAD_FROM, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.bad, self.bad_from = bad, bad_from
        self.forward_calls: dict[int, int] = {}

    def build_optimizer(self):
        return torch.optim.SGD(self.model.parameters(), lr=self.lr, momentum=0.9)

    def forward(self, batch):
        self.forward_calls[self.step] = self.forward_calls.get(self.step, 0) + 1
        loss, records = super().forward(batch)
        if self.bad is not None and self.step >= self.bad_from:
            return self.bad(loss, records, batch)
        return loss, records


class Snapshots(BaseHook):
    """The model's parameters after every completed step."""

    def __init__(self) -> None:
        self.after_step: dict[int, dict[str, torch.Tensor]] = {}

    def on_after_step(self, trainer):
        self.after_step[trainer.step] = params(trainer.model)


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_equal_tree(a: Any, b: Any, where: str = "") -> None:
    """Equal nested containers, tensors compared bitwise."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict), where
        assert a.keys() == b.keys(), where
        for key in a:
            assert_equal_tree(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_equal_tree(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def run_to_fault(tmp_path: Path, error: type[BaseException], match: str, *hooks: BaseHook, **kwargs: Any):
    """Train ``FaultTrainer`` with interval checkpoints until it fails with ``error``.

    Returns the trainer, the snapshots, and the checkpoints directory.
    """
    snapshots = Snapshots()
    kwargs.setdefault("max_steps", 20)
    trainer = FaultTrainer(
        workspace=tmp_path, hooks=[CheckpointingHook(interval=INTERVAL), snapshots, *hooks], **kwargs
    )
    with pytest.raises(error, match=match) as caught:
        trainer.train()
    assert trainer.error is caught.value
    assert trainer.state is State.EXITING
    return trainer, snapshots, tmp_path / "checkpoints"


def assert_checkpoint_intact(root: Path, step: int, snapshots: Snapshots) -> dict[str, Any]:
    """Only ``root/<step>`` (no save after the fault), ``latest`` at it; it loads and holds that
    step's model."""
    assert checkpoint_steps(root) == [step]
    assert latest_checkpoint(root) == root / str(step)
    checkpoint = read_checkpoint(latest_checkpoint(root))
    assert checkpoint["training_state"]["step"] == step
    assert_equal_tree(dict(checkpoint["model"]), snapshots.after_step[step], "model")
    return checkpoint


# -- NaN storm -------------------------------------------------------------------------------


def nan_loss(loss, records, batch):
    return loss * float("nan"), records


@pytest.mark.parametrize("grad_clip", [None, 1.0], ids=["grad-check", "clip-norm"])
def test_nan_storm_exhausts_retries_steps_nothing_and_leaves_the_last_checkpoint(tmp_path, caplog, grad_clip):
    caplog.set_level(logging.WARNING, logger="trainloop")
    trainer, snapshots, root = run_to_fault(
        tmp_path, RuntimeError, r"non-finite gradients at step 5 after 3 retries \(max_non_finite_grad_retries=3\)",
        bad=nan_loss, max_non_finite_grad_retries=3, grad_clip=grad_clip,
    )
    assert trainer.step == BAD_FROM
    assert trainer.forward_calls[BAD_FROM] == 1 + 3  # the step, then 3 retries, all NaN
    assert trainer.step_info.non_finite_grad_retries == 3
    retries = [r.getMessage() for r in caplog.records if "Non-finite gradients" in r.getMessage()]
    assert retries == [f"Non-finite gradients at step 5; retrying ({i}/3)" for i in (1, 2, 3)]
    assert sorted(snapshots.after_step) == [1, 2, 3, 4]  # step 5 never completed

    # No optimizer step on non-finite gradients: model and momentum are the checkpoint's.
    checkpoint = assert_checkpoint_intact(root, GOOD_STEPS, snapshots)
    assert_equal_tree(params(trainer.model), snapshots.after_step[GOOD_STEPS], "model")
    now = trainer.state_dict()
    assert_equal_tree(now["training_state"]["optimizer"], checkpoint["training_state"]["optimizer"], "optimizer")


def test_nan_storm_without_retries_fails_at_once_naming_the_setting(tmp_path):
    trainer, snapshots, root = run_to_fault(
        tmp_path, RuntimeError,
        r"non-finite gradients at step 5; max_non_finite_grad_retries is None, so the step is not retried",
        bad=nan_loss,
    )
    assert trainer.forward_calls[BAD_FROM] == 1
    assert_checkpoint_intact(root, GOOD_STEPS, snapshots)
    assert_equal_tree(params(trainer.model), snapshots.after_step[GOOD_STEPS], "model")


def test_a_run_resumed_from_the_checkpoint_a_nan_storm_left_continues_exactly(tmp_path):
    """The checkpoint left behind is a true continuation point: resumed with healthy data, the
    run ends bitwise where a run that never went NaN ends."""
    loader = pytest.importorskip("torchdata.stateful_dataloader").StatefulDataLoader

    def data():  # a loader whose position the checkpoint holds
        return loader(make_data(), batch_size=8)

    run_to_fault(
        tmp_path, RuntimeError, "max_non_finite_grad_retries=3",
        bad=nan_loss, max_non_finite_grad_retries=3, data=data(), max_steps=10,
    )
    snapshots = Snapshots()
    resumed = FaultTrainer(
        max_steps=10, max_non_finite_grad_retries=3, workspace=tmp_path, data=data(),
        hooks=[CheckpointingHook(interval=INTERVAL), snapshots],
    )
    resumed.train()
    assert sorted(snapshots.after_step) == list(range(BAD_FROM, 11))
    straight = FaultTrainer(max_steps=10, data=data())
    straight.train()
    assert_equal_tree(params(resumed.model), params(straight.model), "model")


# -- forward returning the wrong thing -------------------------------------------------------


BAD_OUTPUTS: dict[str, tuple[Output, type[BaseException], str]] = {
    "non-scalar loss": (
        lambda loss, records, batch: ((batch[0].sum(dim=1, keepdim=True) - batch[1]) ** 2, records),
        TypeError, r"FaultTrainer.forward\(\) must return a scalar tensor loss, got a tensor of shape \(8, 1\)",
    ),
    "python float loss": (
        lambda loss, records, batch: (loss.item(), records),
        TypeError, r"must return a scalar tensor loss, got float",
    ),
    "loss without records": (
        lambda loss, records, batch: loss,
        TypeError, r"FaultTrainer.forward\(\) must return \(loss, records\), got Tensor",
    ),
    "nothing": (
        lambda loss, records, batch: None,
        TypeError, r"must return \(loss, records\), got NoneType",
    ),
    "a triple": (
        lambda loss, records, batch: (loss, records, {}),
        TypeError, r"must return \(loss, records\), got tuple",
    ),
    "Loss with a non-scalar sum": (
        lambda loss, records, batch: (Loss(torch.stack([loss, loss]), 2), records),
        TypeError, r"must return a scalar tensor Loss.sum, got a tensor of shape \(2,\)",
    ),
}


@pytest.mark.parametrize("case", list(BAD_OUTPUTS))
def test_bad_forward_output_is_a_clear_error_and_no_step_is_taken(tmp_path, case):
    bad, error, match = BAD_OUTPUTS[case]
    trainer, snapshots, root = run_to_fault(tmp_path, error, match, bad=bad)
    assert trainer.step == BAD_FROM
    assert sorted(snapshots.after_step) == [1, 2, 3, 4]
    assert_checkpoint_intact(root, GOOD_STEPS, snapshots)
    assert_equal_tree(params(trainer.model), snapshots.after_step[GOOD_STEPS], "model")


# -- records that are not numbers ------------------------------------------------------------


BAD_RECORDS: dict[str, tuple[Callable[[torch.Tensor], dict[str, Any]], type[BaseException], str]] = {
    "a string": (lambda loss: {"mse": loss, "tag": "warmup"}, TypeError, r"record 'tag' is a str, not a number"),
    "nested None": (
        lambda loss: {"mse": loss, "parts": {"aux": None}}, TypeError, r"record 'parts/aux' is a NoneType, not a number"
    ),
    "a per-sample tensor": (
        lambda loss: {"mse": loss, "per_sample": torch.zeros(8, 1)},
        ValueError, r"record 'per_sample' is a tensor of shape \(8, 1\), not a scalar",
    ),
    "a list": (lambda loss: {"mse": [loss, loss]}, TypeError, r"record 'mse' is a list, not a number"),
    "a complex": (lambda loss: {"mse": loss, "z": 1 + 2j}, TypeError, r"record 'z' is a complex, not a number"),
}


@pytest.mark.parametrize("hook_class", [StatsHook, LoggingHook])
@pytest.mark.parametrize("case", list(BAD_RECORDS))
def test_records_that_are_not_numbers_fail_at_aggregation_naming_the_key(tmp_path, case, hook_class):
    make, error, match = BAD_RECORDS[case]
    # Aggregated every 3 steps: the bad records of step 5 are read, and refused, at step 6, a
    # checkpoint step. The save it requested never happens: the error comes first.
    trainer, snapshots, root = run_to_fault(
        tmp_path, error, match, hook_class(interval=3),
        bad=lambda loss, records, batch: (loss, make(loss)),
    )
    assert trainer.step == 6
    assert sorted(snapshots.after_step) == [1, 2, 3, 4, 5, 6]
    assert_checkpoint_intact(root, GOOD_STEPS, snapshots)


@pytest.mark.parametrize("case", list(BAD_RECORDS))
def test_key_average_names_the_key_of_a_value_that_is_not_a_number(case):
    make, error, match = BAD_RECORDS[case]
    with pytest.raises(error, match=match):
        key_average([{"mse": 1.0}, make(torch.tensor(2.0))])


def test_key_average_of_good_records_including_nan():
    assert key_average([{"a": 1, "b": {"c": torch.tensor(2.0)}}, {"a": 3.0}]) == {"a": 2.0, "b": {"c": 2.0}}
    assert key_average([{"a": float("nan")}, {"a": 1.0}], exclude_nan=True) == {"a": 1.0}


NOT_A_MAPPING = {
    "a list": lambda loss, records, batch: (loss, [loss]),
    "a float": lambda loss, records, batch: (loss, 1.0),
    # A bare Loss is a NamedTuple of two: it unpacks as (loss=sum, records=count).
    "a bare Loss(sum, count)": lambda loss, records, batch: Loss(loss * 8, 8),
}


@pytest.mark.parametrize("case", list(NOT_A_MAPPING))
def test_records_that_are_not_a_mapping_are_a_clear_error(tmp_path, case):
    trainer, snapshots, root = run_to_fault(tmp_path, TypeError, r"records", bad=NOT_A_MAPPING[case])
    assert trainer.step == BAD_FROM
    assert_checkpoint_intact(root, GOOD_STEPS, snapshots)


# -- data that runs out ----------------------------------------------------------------------


def batches(n: int) -> list[Any]:
    return list(DataLoader(make_data(8 * n), batch_size=8))


def test_one_shot_iterator_running_out_mid_step_applies_no_partial_step(tmp_path):
    # 5 batches, 2 per step: steps 1 and 2 complete (checkpoint at 2); step 3 draws the 5th
    # batch, then finds the iterator empty.
    trainer, snapshots, root = run_to_fault(
        tmp_path, DataExhaustedError,
        r"the data iterator from build_data_loader\(\) ran out after 5 batches and cannot be iterated again",
        data=iter(batches(5)), gradient_accumulation_steps=2,
    )
    assert trainer.step == 3
    assert sorted(snapshots.after_step) == [1, 2]
    assert trainer.forward_calls == {1: 2, 2: 2, 3: 1}
    assert_checkpoint_intact(root, 2, snapshots)
    assert_equal_tree(params(trainer.model), snapshots.after_step[2], "model")


def test_generator_running_out_between_steps(tmp_path):
    trainer, snapshots, root = run_to_fault(
        tmp_path, DataExhaustedError, r"ran out after 5 batches", data=(b for b in batches(5)),
    )
    assert trainer.step == 6
    assert sorted(snapshots.after_step) == [1, 2, 3, 4, 5]
    assert_checkpoint_intact(root, 4, snapshots)


def test_an_empty_loader_is_an_error_and_writes_no_checkpoint(tmp_path):
    _, _, root = run_to_fault(
        tmp_path, DataExhaustedError, r"the data loader from build_data_loader\(\) yielded no batch in epoch 0",
        data=DataLoader(make_data(0), batch_size=8),
    )
    assert checkpoint_steps(root) == []
    assert latest_checkpoint(root) is None
