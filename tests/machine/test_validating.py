"""The ``validating`` state in training runs: when it is entered, what follows it, what it is given."""

from __future__ import annotations

import json

import pytest
from eval_trainers import EvalTrainer
from helper_hooks import ExitAt

from trainloop.hooks.checkpointing import CheckpointingHook
from trainloop.hooks.early_stopping import EarlyStoppingHook
from trainloop.hooks.validation import ValidationHook
from trainloop.machine import State


def edges(trainer):
    return [(e.source, e.dest, e.step) for e in trainer.trace]


def validating_visits(trainer):
    return [e.step for e in trainer.trace if e.dest is State.VALIDATING]


def test_at_start_validates_between_restoring_and_the_first_step():
    trainer = EvalTrainer(max_steps=4, trace=True, hooks=[ValidationHook("val_metrics", interval=2, at_start=True)])
    trainer.train()
    assert edges(trainer)[2:4] == [
        (State.RESTORING, State.VALIDATING, 0), (State.VALIDATING, State.ACCUMULATING, 0)
    ]
    assert validating_visits(trainer) == [0, 2, 4]
    assert [row["step"] for row in trainer.result.history if "val/loss" in row] == [0, 2, 4]
    # The validation's time is its own state's, not stepping's.
    assert (State.STEPPING, State.VALIDATING, 2) in edges(trainer)


def test_at_start_from_a_settings_file_the_environment_and_set(tmp_path):
    from eval_trainers import EvalSettings

    declared = {"max_steps": 2, "trace": True, "hooks": [{"type": "validation", "evaluate": "val_metrics", "interval": 5}]}
    (tmp_path / "run.json").write_text(json.dumps(declared))
    for env, overrides in [({"TRAINLOOP_HOOKS__VALIDATION__AT_START": "true"}, []), ({}, ["hooks.0.at_start=true"])]:
        trainer = EvalTrainer(EvalSettings.load(tmp_path / "run.json", env=env, overrides=overrides))
        trainer.train()
        assert validating_visits(trainer) == [0, 2]  # at the start, and the last step (at_last_step)
    trainer = EvalTrainer(EvalSettings.load(tmp_path / "run.json", env={}))
    trainer.train()
    assert validating_visits(trainer) == [2]


def test_several_validation_hooks_due_together_run_in_one_visit():
    first, second = ValidationHook("val_metrics", interval=2), ValidationHook("val_metrics", interval=3, prefix="v3")
    first.name, second.name = "every2", "every3"
    trainer = EvalTrainer(max_steps=6, trace=True, hooks=[first, second])
    trainer.train()
    assert validating_visits(trainer) == [2, 3, 4, 6]  # step 6: both, in one visit
    assert (first.last_step, second.last_step) == (6, 6)


def test_a_keep_best_checkpoint_is_judged_on_the_metric_of_its_own_step(tmp_path):
    scores = {2: 0.5, 4: 0.1, 6: 0.9}

    class Scripted(EvalTrainer):
        def val_metrics(self):
            return {"loss": scores[self.step]}

    hooks = [
        ValidationHook("val_metrics", interval=2),
        CheckpointingHook(interval=2, keep_best=1, monitor="val/loss", keep_previous=0),
    ]
    trainer = Scripted(max_steps=6, workspace=tmp_path, trace=True, hooks=hooks)
    result = trainer.train()
    best = json.loads((tmp_path / "checkpoints" / "best.json").read_text())
    assert best["scores"] == {"4": 0.1, "6": 0.9}  # each its own step's value (2 was pruned: worse than 4)
    assert result.best_checkpoint == tmp_path / "checkpoints" / "4"
    # validating comes before checkpointing at each of these steps.
    assert [(s, d) for s, d, step in edges(trainer) if step == 4 and State.VALIDATING in (s, d)] == [
        (State.STEPPING, State.VALIDATING), (State.VALIDATING, State.CHECKPOINTING)
    ]


def test_an_exit_request_without_a_code_validates_the_last_step_in_validating():
    # ExitAt asks for an exit (no code) after step 3: the run ends cleanly, its last step validated.
    trainer = EvalTrainer(max_steps=10, trace=True, hooks=[ValidationHook("val_metrics", interval=5), ExitAt(3)])
    trainer.train()
    assert validating_visits(trainer) == [3]
    assert edges(trainer)[-2:] == [(State.STEPPING, State.VALIDATING, 3), (State.VALIDATING, State.EXITING, 3)]


def test_an_exit_request_with_a_code_leaves_without_validating():
    class ExitWithCode(ExitAt):
        def on_after_step(self, trainer):
            if trainer.step == self.step:
                trainer.request_exit(7)

    trainer = EvalTrainer(max_steps=10, trace=True, hooks=[ValidationHook("val_metrics", interval=1), ExitWithCode(3)])
    with pytest.raises(SystemExit) as exit:
        trainer.train()
    assert exit.value.code == 7
    assert validating_visits(trainer) == [1, 2]


def test_early_stopping_on_the_fresh_metric_ends_the_run_at_that_step():
    class Worse(EvalTrainer):
        def val_metrics(self):
            return {"loss": float(self.step)}  # worse every time

    hooks = [ValidationHook("val_metrics", interval=1), EarlyStoppingHook(monitor="val/loss", patience=2)]
    trainer = Worse(max_steps=20, trace=True, hooks=hooks)
    result = trainer.train()
    assert result.step == 3  # no improvement at 2 and 3: stopped right after validating step 3
    assert edges(trainer)[-1] == (State.VALIDATING, State.EXITING, 3)


def test_graph_of_a_trace_counts_the_validations_and_their_time(tmp_path, capsys):
    from cli_process import call

    hooks = [ValidationHook("val_metrics", interval=2, at_start=True)]
    EvalTrainer(max_steps=4, workspace=tmp_path, trace=True, hooks=hooks).train()
    code, out, err = call(capsys, "graph", "--trace", tmp_path)
    assert code == 0, err
    assert "    restoring --> validating: validate [validation_due] (n=1)\n" in out
    assert "    stepping --> validating: validate [validation_due] (n=2)\n" in out
    assert "    validating --> exiting: finish [should_exit] (n=1)\n" in out
    assert "checkpoints: 0, validations: 3" in err
    assert any(line.split()[0] == "validating" for line in err.splitlines()[1:])
