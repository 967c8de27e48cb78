"""CheckpointingHook(keep_best, monitor, mode): the best checkpoints by a logged metric are kept."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pydantic
import pytest
from helper_hooks import ExitAt
from tiny_trainer import TinyTrainer

from trainloop import CheckpointingHook, TrainerSettings, ValidationHook
from trainloop.checkpoint.manager import checkpoint_steps
from trainloop.hooks.early_stopping import MonitorNotFoundWarning

ROOT = Path(__file__).resolve().parents[2]
# Validation loss by step: best at 4, then 8, then 2.
LOSS = {2: 0.5, 4: 0.1, 6: 0.9, 8: 0.2, 10: 0.7, 12: 0.8}


def validation(values=LOSS, **kwargs):
    return ValidationHook(lambda t: {"loss": values.get(t.step, 1.0)}, interval=2, **kwargs)


def best_json(tmp_path):
    return json.loads((tmp_path / "checkpoints" / "best.json").read_text())


def test_keeps_the_n_best_besides_the_newest_and_points_at_the_best(tmp_path):
    hook = CheckpointingHook(interval=2, keep_best=2, monitor="val/loss")
    result = TinyTrainer(max_steps=12, hooks=[validation(), hook], workspace=tmp_path).train()
    assert checkpoint_steps(tmp_path / "checkpoints") == [4, 8, 12]
    assert result.best_checkpoint == hook.best_checkpoint == tmp_path / "checkpoints" / "4"
    assert best_json(tmp_path) == {"monitor": "val/loss", "mode": "min", "scores": {"4": 0.1, "8": 0.2, "12": 0.8}, "best": 4}


def test_mode_max_and_the_hook_before_the_validation(tmp_path):
    # Hook order does not matter: the save comes after every hook's on_after_step.
    hook = CheckpointingHook(interval=2, keep_best=1, monitor="val/loss", mode="max", keep_previous=0)
    result = TinyTrainer(max_steps=12, hooks=[hook, validation()], workspace=tmp_path).train()
    assert checkpoint_steps(tmp_path / "checkpoints") == [6, 12]
    assert result.best_checkpoint == tmp_path / "checkpoints" / "6"


def test_a_checkpoint_without_the_metric_at_its_step_is_not_a_candidate(tmp_path):
    # Saved every step, validated every 2nd: the odd steps have no score of their own.
    hook = CheckpointingHook(interval=1, keep_best=1, monitor="val/loss")
    result = TinyTrainer(max_steps=5, hooks=[validation({2: 0.3, 4: 0.4}), hook], workspace=tmp_path).train()
    assert checkpoint_steps(tmp_path / "checkpoints") == [2, 5]
    assert best_json(tmp_path)["scores"] == {"2": 0.3, "5": 1.0}  # 5: evaluated as the last step
    assert result.best_checkpoint.name == "2"


def test_the_last_evaluation_after_an_exit_request_scores_the_exit_checkpoint(tmp_path):
    # The exit request at step 5 is settled after the step: the exit save comes first, the
    # evaluation of the same weights in on_after_train, and the checkpoint takes its score.
    hook = CheckpointingHook(interval=2, keep_best=1, monitor="val/loss")
    values = {2: 0.5, 4: 0.4, 5: 0.01}
    result = TinyTrainer(max_steps=20, hooks=[hook, validation(values), ExitAt(5)], workspace=tmp_path).train()
    assert result.best_checkpoint == tmp_path / "checkpoints" / "5"
    assert checkpoint_steps(tmp_path / "checkpoints") == [5]


def test_scores_survive_a_resume(tmp_path):
    def hooks():
        return [validation(), CheckpointingHook(interval=2, keep_best=1, monitor="val/loss")]

    TinyTrainer(max_steps=6, hooks=hooks(), workspace=tmp_path).train()
    result = TinyTrainer(max_steps=12, hooks=hooks(), workspace=tmp_path).train()
    assert checkpoint_steps(tmp_path / "checkpoints") == [4, 12]  # 4, best of both runs, never pruned
    assert result.best_checkpoint.name == "4"


def test_a_monitor_that_never_appears_is_a_warning_with_did_you_mean(tmp_path):
    hook = CheckpointingHook(interval=2, keep_best=1, monitor="val/los")
    with pytest.warns(MonitorNotFoundWarning, match=r"'val/los' never appeared.*did you mean 'val/loss'\?"):
        result = TinyTrainer(max_steps=4, hooks=[validation(), hook], workspace=tmp_path).train()
    assert result.best_checkpoint is None
    assert checkpoint_steps(tmp_path / "checkpoints") == [4]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"keep_best": 1}, "keep_best=1 needs a monitor"),
        ({"monitor": "val/loss"}, "monitor='val/loss' needs keep_best >= 1"),
    ],
)
def test_keep_best_and_monitor_come_together(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CheckpointingHook(interval=1, **kwargs)
    with pytest.raises(pydantic.ValidationError, match=rf"hooks.0.monitor\n.*{message}"):
        TrainerSettings.model_validate({"max_steps": 1, "hooks": [{"type": "checkpointing", "interval": 1, **kwargs}]})


def test_a_typo_in_mode_is_a_validation_error_naming_it(tmp_path):
    with pytest.raises(pydantic.ValidationError, match=r"mode\n.*Input should be 'min' or 'max'"):
        CheckpointingHook(interval=1, keep_best=1, monitor="val/loss", mode="minimum")
    settings = {"max_steps": 2, "workspace": str(tmp_path / "run"),
                "hooks": [{"type": "checkpointing", "interval": 1, "keep_best": 1, "monitor": "val/loss", "mode": "mn"}]}
    (tmp_path / "run.json").write_text(json.dumps(settings))
    result = subprocess.run(
        [sys.executable, "-m", "trainloop", "validate", "run.json"], cwd=tmp_path, capture_output=True, text=True, check=False,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])},
    )
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr == "trainloop validate: error: run.json: hooks[0].mode: Input should be 'min' or 'max' (got 'mn')\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json"]


@pytest.mark.parametrize(("mode", "diverged"), [("min", float("-inf")), ("max", float("inf"))])
def test_a_diverged_score_is_never_the_best(tmp_path, mode, diverged):
    # Step 4 is the real best either way; step 6 logs what a diverged run logs, which the mode
    # would otherwise rank first: it must neither be best nor push the real best out.
    values = {2: 0.5, 4: 0.1 if mode == "min" else 0.9, 6: diverged, 8: 0.3 if mode == "min" else 0.7}
    hook = CheckpointingHook(interval=2, keep_best=1, monitor="val/loss", mode=mode, keep_previous=0)
    result = TinyTrainer(max_steps=8, hooks=[validation(values), hook], workspace=tmp_path).train()
    assert result.best_checkpoint == hook.best_checkpoint == tmp_path / "checkpoints" / "4"
    assert checkpoint_steps(tmp_path / "checkpoints") == [4, 8]
