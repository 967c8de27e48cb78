"""RunResult: what train() returns, and trainer.result after a signal exit."""

from __future__ import annotations

import json
import math
import signal
from pathlib import Path

import pytest
import torch
from helper_hooks import SignalAtStep
from tiny_trainer import TinyTrainer

from trainloop import CheckpointingHook, LoggingHook, ValidationHook
from trainloop.core.result import RunResult


def test_train_returns_the_runs_result_with_the_last_of_every_logged_key(tmp_path):
    hooks = [
        LoggingHook(interval=2),
        ValidationHook(lambda t: {"loss": torch.tensor(0.5 / t.step), "acc": {"top1": t.step}}, interval=3),
    ]
    trainer = TinyTrainer(max_steps=7, hooks=hooks)
    result = trainer.train()
    assert isinstance(result, RunResult)
    assert trainer.result is result
    assert (result.step, result.epoch, result.exit_code, result.best_checkpoint) == (7, 0, 0, None)
    assert result.metrics["val/loss"] == pytest.approx(0.5 / 7)
    assert result.metrics["val/acc/top1"] == 7.0
    assert set(result.metrics) >= {"loss", "lr/group_0", "step_time", "data_time", "records/mse"}
    assert all(type(v) is float for v in result.metrics.values())
    # The history holds every call, in order (hook order within a step), with its step.
    assert [(r["step"], "val/loss" in r) for r in result.history] == [
        (2, False), (3, True), (4, False), (6, False), (6, True), (7, False), (7, True),
    ]
    assert math.isfinite(result.history[-2]["loss"])


def test_the_best_checkpoint_is_the_results(tmp_path):
    hook = CheckpointingHook(interval=2, keep_best=1, monitor="val/loss")
    validation = ValidationHook(lambda t: {"loss": abs(t.step - 4)}, interval=2)
    result = TinyTrainer(max_steps=8, hooks=[validation, hook], workspace=tmp_path).train()
    assert result.best_checkpoint == tmp_path / "checkpoints" / "4"
    assert isinstance(result.best_checkpoint, Path)
    assert result.best_checkpoint.is_dir()


def test_a_signal_exit_raises_and_leaves_the_result_on_the_trainer(tmp_path):
    hooks = [CheckpointingHook(interval=100, exit_signals=["SIGUSR1"]), SignalAtStep(3, signal.SIGUSR1)]
    trainer = TinyTrainer(max_steps=10, hooks=hooks, workspace=tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        trainer.train()
    assert exit_info.value.code == 128 + signal.SIGUSR1
    assert (trainer.result.step, trainer.result.exit_code) == (3, 128 + signal.SIGUSR1)


def test_an_error_still_leaves_a_result(tmp_path):
    class Boom(LoggingHook):
        def on_after_step(self, trainer):
            if trainer.step == 2:
                raise RuntimeError("boom")

    trainer = TinyTrainer(max_steps=5, hooks=[Boom()], workspace=tmp_path)
    with pytest.raises(RuntimeError, match="boom"):
        trainer.train()
    # The result says the run failed: an error's exit code (what the process exits with), and the error.
    assert (trainer.result.step, trainer.result.exit_code, trainer.result.error) == (2, 1, "RuntimeError: boom")
    (line,) = [json.loads(text) for text in (tmp_path / "runs.jsonl").read_text().splitlines()]
    assert (line["exit_code"], line["error"]) == (1, "RuntimeError: boom")


def test_a_clean_run_has_no_error():
    result = TinyTrainer(max_steps=2).train()
    assert (result.exit_code, result.error) == (0, None)


def test_runs_jsonl_records_when_the_run_started_and_on_what(tmp_path):
    import time

    import trainloop

    before = time.time()
    TinyTrainer(max_steps=2, workspace=tmp_path).train()
    (line,) = [json.loads(text) for text in (tmp_path / "runs.jsonl").read_text().splitlines()]
    assert before <= line["started"] <= line["time"] <= time.time()
    assert (line["device"], line["torch"], line["trainloop"]) == ("cpu", torch.__version__, trainloop.__version__)
