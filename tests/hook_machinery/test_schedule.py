"""Schedules as data: a hook declares when it acts (``hook.schedule``), the dispatcher applies the
one every(n) rule and calls ``on_schedule`` only when due, and ``trainloop graph`` and the run
report show each hook beside the state it acts in, with its schedule in words."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from cli_process import Cli, assert_one_clean_error, cli_env
from helper_hooks import ExitAt
from tiny_trainer import TinyTrainer

from trainloop import BaseHook, CheckpointingHook, LoggingHook, ProgressHook, TrainerSettings, ValidationHook
from trainloop.hook_machinery.dispatch import Every
from trainloop.hooks import Schedule


class Scheduled(BaseHook):
    """Records the step and the machine's state of each ``on_schedule`` call."""

    def __init__(self, **schedule):
        self.schedule = Schedule(**schedule)
        self.calls: list[tuple[int, str]] = []

    def on_schedule(self, trainer):
        self.calls.append((trainer.step, trainer.state.value))


@pytest.mark.parametrize(
    ("schedule", "settings", "extra", "expected"),
    [
        ({"every": 3}, {"max_steps": 7}, [], [(3, "stepping"), (6, "stepping"), (7, "stepping")]),
        ({"every": 3, "at_end": False}, {"max_steps": 7}, [], [(3, "stepping"), (6, "stepping")]),
        ({"every": 3, "at_start": True}, {"max_steps": 6}, [], [(0, "restoring"), (3, "stepping"), (6, "stepping")]),
        # An exit request is settled after the step's hooks: its last step is acted on in exiting.
        ({"every": 3}, {"max_steps": 20}, [ExitAt(5)], [(3, "stepping"), (5, "exiting")]),
        # 8 steps an epoch: every 2nd epoch ends at step 16, the run at 24.
        ({"every": 2, "unit": "epochs"}, {"max_epochs": 3}, [], [(16, "stepping"), (24, "stepping")]),
    ],
)
def test_a_declared_schedule_is_applied_by_the_one_rule(schedule, settings, extra, expected):
    hook = Scheduled(**schedule)
    TinyTrainer(**settings, hooks=[hook, *extra]).train()
    assert hook.calls == expected


def test_on_schedule_follows_its_own_on_after_step_so_hooks_keep_their_order():
    seen: list[str] = []

    class Both(Scheduled):
        def __init__(self, label):
            super().__init__(every=2, at_end=False)
            self.label = label

        def on_after_step(self, trainer):
            seen.append(f"{self.label}.after {trainer.step}")

        def on_schedule(self, trainer):
            seen.append(f"{self.label}.schedule {trainer.step}")

    TinyTrainer(max_steps=2, hooks=[Both("a"), Both("b")]).train()
    assert seen == ["a.after 1", "b.after 1", "a.after 2", "a.schedule 2", "b.after 2", "b.schedule 2"]


def test_steps_on_which_nothing_is_due_do_not_ask_the_rule(monkeypatch):
    asked: list[int] = []
    due = Every.due

    def counted(self, step, *args):
        asked.append(step)
        return due(self, step, *args)

    monkeypatch.setattr(Every, "due", counted)
    hook = Scheduled(every=5)
    TinyTrainer(max_steps=12, hooks=[hook]).train()
    assert [step for step, _ in hook.calls] == [5, 10, 12]
    # The first step works out when anything is due next; then only those steps ask.
    assert asked == [1, 5, 10, 12]


def test_a_run_ended_by_an_error_is_not_acted_on_at_its_end():
    class Crash(BaseHook):
        def on_after_step(self, trainer):
            if trainer.step == 4:
                raise RuntimeError("boom")

    hook = Scheduled(every=3)
    with pytest.raises(RuntimeError, match="boom"):
        TinyTrainer(max_steps=10, hooks=[hook, Crash()]).train()
    assert hook.calls == [(3, "stepping")]


def test_half_a_declaration_is_an_error_when_the_hooks_are_built():
    class NoAction(BaseHook):
        schedule = Schedule(every=2)

    class NoSchedule(BaseHook):
        def on_schedule(self, trainer):
            pass

    with pytest.raises(TypeError, match="NoAction declares a schedule but no on_schedule"):
        TinyTrainer(max_steps=2, hooks=[NoAction()]).train()
    with pytest.raises(TypeError, match="NoSchedule.on_schedule would never be called"):
        TinyTrainer(max_steps=2, hooks=[NoSchedule()]).train()


def test_built_in_periodic_hooks_declare_their_schedules_from_their_settings():
    assert CheckpointingHook(interval=1000).schedule == Schedule(1000, state="checkpointing")
    assert CheckpointingHook(interval=2, unit="epochs").schedule == Schedule(2, "epochs", state="checkpointing")
    kept = CheckpointingHook(interval=10, keep_interval=25, keep_steps=[7, 3]).schedule
    assert kept == Schedule(10, state="checkpointing", also_every=25, also_at=frozenset({3, 7}))
    assert kept.describe() == "every 10 steps, every 25 steps, at steps 3, 7 and at the end"
    validating = Schedule(5, at_end=False, state="validating", at_exit_signal=False)
    assert ValidationHook("val_metrics", interval=5, at_last_step=False).schedule == validating
    assert ValidationHook("val_metrics", interval=5, at_start=True, on_exit_signal="validate").schedule == Schedule(
        5, at_start=True, state="validating", at_exit_signal=True
    )
    assert LoggingHook(interval=7).schedule == Schedule(7)
    assert ProgressHook().schedule == Schedule(1)


@pytest.mark.parametrize(
    ("schedule", "words"),
    [
        (Schedule(1000), "every 1000 steps and at the end"),
        (Schedule(1), "every step and at the end"),
        (Schedule(2, "epochs", at_end=False), "every 2 epochs"),
        (Schedule(1, "epochs", at_end=False, at_start=True), "at the start and every epoch"),
        (Schedule(10, at_start=True), "at the start, every 10 steps and at the end"),
    ],
)
def test_a_schedule_in_words(schedule, words):
    assert schedule.describe() == words


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"every": 0}, "Schedule every=0: every is a whole number of steps or epochs, at least 1"),
        # 2.5 would act at 5, 10, ...; inf only at the end; True reads as 1.
        ({"every": 2.5}, "Schedule every=2.5: every is a whole number of steps or epochs, at least 1"),
        ({"every": float("inf")}, "Schedule every=inf: every is a whole number of steps or epochs, at least 1"),
        ({"every": True}, "Schedule every=True: every is a whole number of steps or epochs, at least 1"),
        ({"every": -3}, "Schedule every=-3: every is a whole number of steps or epochs, at least 1"),
        ({"every": 2, "also_every": 1.5}, "Schedule also_every=1.5: also_every is a whole number of steps, 0 (none)"),
        ({"every": 2, "also_every": -1}, "Schedule also_every=-1: also_every is a whole number of steps, 0 (none)"),
        ({"every": 2, "also_at": [3, 0]}, "Schedule also_at holds 0: each is a step number, a whole number of at least 1"),
        ({"every": 2, "also_at": 3}, "Schedule also_at=3: give a set of step numbers"),
        ({"every": 2, "at_end": "no"}, "Schedule at_end='no': give True or False"),
        ({"every": 2, "unit": "hours"}, "'hours'"),
        ({"every": 2, "state": "exiting"}, "'exiting'"),
    ],
)
def test_a_bad_schedule_is_an_error(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Schedule(**kwargs)


def test_steps_given_as_a_list_are_the_set_they_mean():
    assert Schedule(2, also_at=[4, 3, 4]) == Schedule(2, also_at=frozenset({3, 4}))


EVERY = "every_printer"  # registered by tests/support/typo_hook_trainer.py: its every may be any number


@pytest.mark.parametrize("command", ["validate", "run"])
def test_a_declared_hook_whose_schedule_is_refused_is_one_line_before_anything_is_written(tmp_path, command):
    settings = {"max_steps": 3, "workspace": "ws", "trainer": "typo_hook_trainer:TypoHookTrainer",
                "hooks": [{"type": EVERY, "every": 2.5}]}
    (tmp_path / "run.json").write_text(json.dumps(settings))
    result = Cli(command, "run.json", cwd=tmp_path, env=cli_env()).result()
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.splitlines() == [
        f"trainloop {command}: error: run.json: hooks[0]: EveryPrinter: Schedule every=2.5: every is a whole number "
        "of steps or epochs, at least 1"
    ]
    assert [p.name for p in tmp_path.iterdir()] == ["run.json"]


SETTINGS = {
    "max_steps": 4,
    "hooks": [
        {"type": "checkpointing", "interval": 1000},
        {"type": "validation", "evaluate": "val_metrics", "interval": 2, "unit": "epochs", "at_last_step": False},
        {"type": "ema"},
    ],
}
LINES = [
    "checkpointing — CheckpointingHook, in checkpointing, every 1000 steps and at the end",
    "validation — ValidationHook, in validating, every 2 epochs",
    "ema — EmaHook, after stepping, every step",
]


@pytest.mark.parametrize("format", ["mermaid", "dot"])
def test_graph_with_settings_shows_each_hook_beside_its_state_with_its_schedule(tmp_path, format):
    (tmp_path / "run.json").write_text(json.dumps(SETTINGS))
    result = Cli("graph", "--format", format, "--settings", "run.json", cwd=tmp_path, env=cli_env()).result()
    assert result.returncode == 0, result.stderr
    for line in LINES:
        assert line in result.stdout
    if format == "mermaid":
        notes = result.stdout.split("note right of stepping\n", 1)[1].split("    end note", 1)[0]
        assert [line.strip() for line in notes.splitlines()] == [LINES[2]]
        notes = result.stdout.split("note right of validating\n", 1)[1].split("    end note", 1)[0]
        assert [line.strip() for line in notes.splitlines()] == [LINES[1]]
        notes = result.stdout.split("note right of checkpointing\n", 1)[1].split("    end note", 1)[0]
        assert [line.strip() for line in notes.splitlines()] == [LINES[0]]


def test_graph_with_settings_that_do_not_validate_exits_2_naming_the_field(tmp_path):
    (tmp_path / "run.json").write_text(json.dumps({"max_steps": 4, "hooks": [{"type": "checkpointing", "interval": 0}]}))
    result = Cli("graph", "--settings", "run.json", cwd=tmp_path, env=cli_env()).result()
    assert result.returncode == 2
    assert result.stdout == ""
    assert_one_clean_error(result.stderr)
    assert "hooks[0].interval" in result.stderr
    assert len(result.stderr.splitlines()) == 1


def test_the_report_lists_the_declared_hooks_with_their_schedules(tmp_path):
    workspace = tmp_path / "ws"
    settings = TrainerSettings.model_validate({**SETTINGS, "workspace": str(workspace)})

    class WithEvaluate(TinyTrainer):
        def val_metrics(self):
            return {"loss": 1.0}

    WithEvaluate(settings).train()
    repo = Path(__file__).resolve().parents[2]
    env = {**cli_env(), "PYTHONPATH": str(repo)}
    result = subprocess.run(
        [sys.executable, "-m", "trainloop", "report", str(workspace)], capture_output=True, text=True, env=env, check=False
    )
    assert result.returncode == 0, result.stderr
    page = (workspace / "report.html").read_text()
    for line in LINES:
        assert f"<td>{line}</td>" in page
    assert "<td>checkpointing</td><td>checkpointing — CheckpointingHook" in page
    assert "<td>validating</td><td>validation — ValidationHook" in page
