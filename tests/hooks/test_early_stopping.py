"""EarlyStoppingHook: stopping real runs on a metric fed by a ValidationHook, state, bad input."""

from __future__ import annotations

import logging
import math
import warnings

import pydantic
import pytest
import torch
from helper_hooks import CaptureHook
from tiny_trainer import TinyTrainer

from trainloop import BaseHook, State
from trainloop.hook_machinery.registry import HOOK_TYPES, hook_settings_model
from trainloop.hooks import Schedule
from trainloop.hooks.early_stopping import EarlyStoppingHook, MonitorNotFoundWarning
from trainloop.hooks.validation import ValidationHook


class Script:
    """An evaluation returning a scripted sequence of ``{"loss": value}``, one per call."""

    def __init__(self, values, key="loss"):
        self.values = list(values)
        self.key = key
        self.steps: list[int] = []

    def __call__(self, trainer):
        self.steps.append(trainer.step)
        return {self.key: self.values[len(self.steps) - 1]}


class CheckpointRecorder(BaseHook):
    """Saves (records) in ``checkpointing`` at the end of the run, and every ``every`` steps."""

    def __init__(self, every: int = 10**9) -> None:
        self.steps: list[int] = []
        self.schedule = Schedule(every, state="checkpointing")

    def on_schedule(self, trainer):
        self.steps.append(trainer.step)


def run(values, max_steps=50, interval=2, extra_hooks=(), **stopper_kwargs):
    script = Script(values)
    stopper = EarlyStoppingHook(**{"monitor": "val/loss", **stopper_kwargs})
    capture = CaptureHook()
    trainer = TinyTrainer(
        max_steps=max_steps,
        hooks=[ValidationHook(script, interval=interval), stopper, capture, *extra_hooks],
    )
    trainer.train()
    return trainer, stopper, script, capture


def test_stops_a_real_run_when_patience_runs_out():
    # Observations at steps 2, 4, 6, 8: best 5, best 4, no improvement twice -> stop at step 8.
    trainer, stopper, script, capture = run([5.0, 4.0, 4.5, 4.2, 1.0, 1.0], patience=2)
    assert script.steps == [2, 4, 6, 8]
    assert trainer.step == 8 < trainer.max_steps
    assert trainer.state is State.EXITING
    assert trainer.error is None
    assert trainer.exit_code is None
    assert [c[2] for c in capture.events("on_after_step")] == list(range(1, 9))
    assert capture.events("on_after_train") == [("on_after_train", "exiting", 8)]
    assert (stopper.best, stopper.bad_count, stopper.observations, stopper.stopped_step) == (4.0, 2, 4, 8)


def test_improvement_resets_the_count():
    values = [3.0, 3.5, 2.0, 2.5, 2.1, 1.0, 1.5, 1.2, 1.1, 9.0]
    trainer, stopper, script, _ = run(values, interval=1, patience=3)
    # 3 best, bad, 2 best, bad, bad, 1 best, bad, bad, bad -> stop at the 9th observation.
    assert trainer.step == 9
    assert stopper.best == 1.0
    assert stopper.bad_count == 3


def test_min_delta_requires_a_real_improvement():
    trainer, stopper, _, _ = run([1.0, 0.95, 0.91, 0.5], interval=1, patience=2, min_delta=0.1)
    assert trainer.step == 3  # 0.95 and 0.91 do not beat 1.0 by more than 0.1
    assert stopper.best == 1.0


def test_mode_max():
    trainer, stopper, _, _ = run([0.1, 0.5, 0.4, 0.5, 0.45, 0.9], interval=1, mode="max", patience=3)
    assert trainer.step == 5  # equal to the best is no improvement
    assert stopper.best == 0.5

    # The same sequence under "min" improves only at 0.1, so it stops earlier.
    trainer, stopper, _, _ = run([0.1, 0.5, 0.4, 0.5, 0.45, 0.9], interval=1, mode="min", patience=3)
    assert trainer.step == 4
    assert stopper.best == 0.1


def test_runs_to_max_steps_while_improving():
    trainer, stopper, script, _ = run([5.0, 4.0, 3.0, 2.0, 1.0], max_steps=10, patience=1)
    assert trainer.step == 10
    assert script.steps == [2, 4, 6, 8, 10]
    assert stopper.stopped_step is None
    assert stopper.bad_count == 0
    assert stopper.best == 1.0


def test_nan_counts_as_no_improvement_and_tensors_are_read():
    values = [torch.tensor(2.0), torch.tensor(math.nan), torch.tensor(math.nan), torch.tensor(1.0)]
    trainer, stopper, _, _ = run(values, interval=1, patience=2)
    assert trainer.step == 3
    assert stopper.best == 2.0
    assert isinstance(stopper.best, float)


def test_first_observation_nan_then_finite():
    trainer, stopper, _, _ = run([math.nan, 3.0, 4.0], max_steps=3, interval=1, patience=2)
    assert trainer.step == 3
    assert stopper.stopped_step is None
    assert stopper.best == 3.0
    assert stopper.bad_count == 1


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        ("low", TypeError, "is a str, not a number"),
        (torch.ones(2), ValueError, r"is a tensor of shape \(2,\), not a scalar"),
    ],
)
def test_non_numeric_metric_is_an_error(value, error, match):
    trainer = TinyTrainer(max_steps=1)
    with pytest.raises(error, match=f"'val/loss' {match}"):
        EarlyStoppingHook("val/loss").on_log(trainer, {"val": {"loss": value}})


def test_the_end_of_run_save_is_taken_once_at_the_stop_step():
    recorder = CheckpointRecorder()
    trainer, stopper, _, _ = run([5.0, 6.0, 7.0], patience=2, extra_hooks=[recorder])
    assert trainer.step == 6 == stopper.stopped_step
    assert recorder.steps == [6]
    assert trainer.state is State.EXITING


def test_stop_on_a_step_that_was_already_checkpointed_saves_once():
    recorder = CheckpointRecorder(every=2)
    trainer, _, _, _ = run([5.0, 6.0, 7.0], patience=2, extra_hooks=[recorder])
    assert trainer.step == 6
    assert recorder.steps == [2, 4, 6]


class Loader(BaseHook):
    """Loads a trainer state dict on entering ``restoring`` (what a checkpointing hook does)."""

    def __init__(self, state_dict) -> None:
        self.state_dict = state_dict

    def on_enter_restoring(self, trainer):
        trainer.load_state_dict(self.state_dict)


def test_state_round_trip_resumes_the_count():
    # First run: best 4 at step 4, no improvement at step 6; ends at max_steps.
    trainer, stopper, _, _ = run([5.0, 4.0, 4.5], max_steps=6, patience=2)
    assert trainer.step == 6
    assert stopper.stopped_step is None
    state_dict = trainer.state_dict()
    assert state_dict[stopper.name] == {
        "monitor": "val/loss", "mode": "min", "best": 4.0, "bad_count": 1, "observations": 3,
    }
    # Resumed run: one more observation without improvement (step 8) exhausts patience.
    resumed, stopper2, script2, _ = run([4.1, 1.0], patience=2, extra_hooks=[Loader(state_dict)])
    assert script2.steps == [8]
    assert resumed.step == 8
    assert (stopper2.best, stopper2.bad_count, stopper2.observations) == (4.0, 2, 4)


def test_state_survives_torch_save_with_weights_only(tmp_path):
    trainer, stopper, _, _ = run([5.0, 4.0, 4.5], max_steps=6, patience=2)
    torch.save(trainer.state_dict(), tmp_path / "ckpt.pt")
    loaded = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    fresh = EarlyStoppingHook("val/loss", patience=2)
    fresh.on_load_state_dict(TinyTrainer(max_steps=1), loaded)
    assert (fresh.best, fresh.bad_count, fresh.observations) == (4.0, 1, 3)


def test_two_hooks_keep_separate_state():
    results = iter([{"loss": 1.0, "acc": 0.5}, {"loss": 2.0, "acc": 0.6}])
    by_loss = EarlyStoppingHook("val/m/loss", patience=5)
    by_acc = EarlyStoppingHook("val/m/acc", mode="max", patience=5)
    by_acc.name = "stop_by_acc"
    trainer = TinyTrainer(
        max_steps=2, hooks=[ValidationHook(lambda t: {"m": next(results)}, interval=1), by_loss, by_acc]
    )
    trainer.train()
    state_dict = trainer.state_dict()
    assert (by_loss.name, by_acc.name) == ("early_stopping_hook", "stop_by_acc")
    assert state_dict["early_stopping_hook"]["best"] == 1.0
    assert state_dict["early_stopping_hook"]["bad_count"] == 1
    assert state_dict["stop_by_acc"]["best"] == 0.6
    assert state_dict["stop_by_acc"]["bad_count"] == 0


def test_load_of_another_metric_or_a_checkpoint_without_state_starts_afresh(caplog):
    trainer = TinyTrainer(max_steps=1)
    hook = EarlyStoppingHook("val/loss", patience=2)
    saved = {"monitor": "val/acc", "mode": "max", "best": 0.9, "bad_count": 1, "observations": 5}
    other = {hook.name: saved}
    with caplog.at_level(logging.WARNING, logger="trainloop"):
        hook.on_load_state_dict(trainer, other)
        hook.on_load_state_dict(trainer, {"model": {}})
    assert (hook.best, hook.bad_count, hook.observations) == (None, 0, 0)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2
    assert "monitored 'val/acc' (max)" in messages[0]
    assert "'val/loss' (min)" in messages[0]
    assert "no early-stopping state" in messages[1]


def test_warns_once_when_the_monitored_key_never_appears():
    expected = r"'val/los' never appeared.*did you mean 'val/loss'"
    with pytest.warns(MonitorNotFoundWarning, match=expected) as record:
        trainer, stopper, script, _ = run([5.0] * 10, max_steps=10, interval=2, monitor="val/los", patience=1)
    assert len([w for w in record if w.category is MonitorNotFoundWarning]) == 1
    assert trainer.step == 10
    assert len(script.steps) == 5
    assert stopper.observations == 0

    # Nothing close: the warning lists what was logged.
    with pytest.warns(MonitorNotFoundWarning, match=r"keys logged: val/loss"):
        run([5.0] * 2, max_steps=4, monitor="train/accuracy")


def test_no_warning_when_observed_or_when_the_run_failed():
    with warnings.catch_warnings():
        warnings.simplefilter("error", MonitorNotFoundWarning)
        run([5.0, 4.0], max_steps=4)

        def broken(trainer):
            raise RuntimeError("boom")

        trainer = TinyTrainer(
            max_steps=4, hooks=[ValidationHook(broken, interval=2), EarlyStoppingHook("val/loss")]
        )
        with pytest.raises(RuntimeError, match="boom"):
            trainer.train()


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"patience": 0}, "patience"),
        ({"patience": -1}, "patience"),
        ({"patience": 2.5}, "patience"),
        ({"patience": "3"}, "patience"),
        ({"mode": "avg"}, "mode"),
        ({"mode": "MIN"}, "mode"),
        ({"min_delta": -0.1}, "min_delta"),
        ({"min_delta": math.inf}, "min_delta"),
        ({"min_delta": math.nan}, "min_delta"),
        ({"min_delta": "0.1"}, "min_delta"),
        ({"monitor": ""}, "monitor"),
        ({"monitor": 3}, "monitor"),
    ],
)
def test_bad_parameters(kwargs, param):
    with pytest.raises(pydantic.ValidationError) as info:
        EarlyStoppingHook(**{"monitor": "val/loss", **kwargs})
    assert {error["loc"][0] for error in info.value.errors()} == {param}


def test_monitor_is_required():
    with pytest.raises(pydantic.ValidationError, match="monitor"):
        EarlyStoppingHook()


def test_registered_and_declarable_in_settings():
    assert HOOK_TYPES["early_stopping"] is EarlyStoppingHook
    model = hook_settings_model(EarlyStoppingHook)
    schema = model.model_json_schema()
    assert schema["properties"]["mode"]["enum"] == ["min", "max"]
    assert schema["required"] == ["type", "monitor"]
    hook = model.model_validate_json(
        '{"type": "early_stopping", "monitor": "val/acc", "mode": "max", "patience": 4, "min_delta": 0}'
    ).build()
    assert isinstance(hook, EarlyStoppingHook)
    assert (hook.monitor, hook.mode, hook.patience, hook.min_delta) == ("val/acc", "max", 4, 0.0)
    with pytest.raises(pydantic.ValidationError, match="patience"):
        model.model_validate({"type": "early_stopping", "monitor": "val/acc", "patience": 0})
