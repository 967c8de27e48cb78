"""The one preflight: what validates runs, and a run that cannot work writes nothing.

``trainloop validate``, ``trainloop run`` (real subprocesses) and ``train()`` report the same
problems, one line each, before anything is built or written.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from cli_process import Cli, assert_one_clean_error, call, cli_env
from tiny_trainer import TinyTrainer

from trainloop import PreflightError, TrainerSettings
from trainloop.core.preflight import preflight

TRAINER = "cli_trainers:CliTrainer"

# A workspace, a trace and TensorBoard: all would be written before the old run crashed.
DOOMED = {
    "max_steps": 3,
    "workspace": "ws",
    "trace": True,
    "hooks": [
        {"type": "tensorboard"},
        {"type": "validation", "evaluate": "evaluat", "interval": 1},
        {"type": "checkpointing", "interval": 2, "load": "no/such/checkpoint"},
    ],
}
DOOMED_LINES = [
    "run.json: hooks[1].evaluate: CliTrainer has no method 'evaluat'",
    "run.json: hooks[2].load: no checkpoint directory at 'no/such/checkpoint'",
]
NO_WORKSPACE = {"max_steps": 3, "hooks": [{"type": "checkpointing", "interval": 2}, {"type": "tensorboard"}]}
NO_WORKSPACE_LINES = [
    "run.json: hooks[0].path: checkpoints go to 'checkpoints', a relative path, but no workspace is set: set workspace or give an absolute path",
    "run.json: hooks[1].log_dir: event files go to <workspace>/tensorboard, but no workspace is set: set workspace or give an absolute path",
]

# Declared hooks that would never act: a misspelt hook method, a schedule with nothing to call.
TYPO = {
    "max_steps": 3, "workspace": "ws", "trainer": "typo_hook_trainer:TypoHookTrainer",
    "hooks": [{"type": "typo_printer"}, {"type": "silent_printer"}],
}


pytestmark = pytest.mark.usefixtures("isolated_cli")  # see tests/conftest.py


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Cli, Path]]:
    """The CLI runs of this module, started at once so their torch imports overlap."""
    runs = {}
    for name, settings, command in [
        ("run_doomed", DOOMED, ["run", "run.json", "--trainer", TRAINER]),
        ("validate_doomed", DOOMED, ["validate", "run.json", "--trainer", TRAINER]),
        # The trainer named in the file, no --trainer.
        ("run_named", {"max_steps": 2, "workspace": "ws", "trainer": TRAINER}, ["run", "run.json"]),
        *((f"{command}_typo", TYPO, [command, "run.json"]) for command in ("run", "validate")),
    ]:
        root = tmp_path_factory.mktemp(name)
        (root / "run.json").write_text(json.dumps(settings))
        runs[name] = (Cli(*command, cwd=root, env=cli_env()), root)
    return runs


@pytest.mark.parametrize("command", ["run", "validate"])
def test_a_run_that_cannot_work_exits_2_one_line_each_and_writes_nothing(launched, command):
    process, root = launched[f"{command}_doomed"]
    result = process.result()
    assert result.returncode == 2
    assert result.stdout == ""
    assert_one_clean_error(result.stderr)
    assert result.stderr.splitlines() == [f"trainloop {command}: error: {line}" for line in DOOMED_LINES]
    assert [p.name for p in root.iterdir()] == ["run.json"]  # no ws/, settings.json, trace, events


@pytest.mark.parametrize("command", ["run", "validate"])
def test_declared_hooks_that_would_never_act_are_refused_before_anything_is_written(launched, command):
    process, root = launched[f"{command}_typo"]
    result = process.result()
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.splitlines() == [
        f"trainloop {command}: error: run.json: hooks[0]: TypoPrinter.on_after_steps is not a hook method, so it "
        "would never be called; did you mean on_after_step?",
        f"trainloop {command}: error: run.json: hooks[1]: SilentPrinter declares a schedule but no on_schedule() "
        "method to call when it is due",
    ]
    assert [p.name for p in root.iterdir()] == ["run.json"]


@pytest.mark.parametrize("command", ["run", "validate"])
def test_paths_that_need_a_workspace_are_found_by_validate_and_run(tmp_path, capsys, command):
    (tmp_path / "run.json").write_text(json.dumps(NO_WORKSPACE))
    code, out, err = call(capsys, command, "run.json", "--trainer", TRAINER)
    assert code == 2
    assert out == ""
    assert err.splitlines() == [f"trainloop {command}: error: {line}" for line in NO_WORKSPACE_LINES]
    assert [p.name for p in tmp_path.iterdir()] == ["run.json"]


def test_bad_values_name_their_file_or_variable_and_field_as_written(tmp_path, capsys, monkeypatch):
    (tmp_path / "run.json").write_text('{"max_steps": 3, "hooks": [{"type": "checkpointing", "interval": 2, "exit_code": 300}]}')
    monkeypatch.setenv("TRAINLOOP_OPTIMIZER__NAME", "SGD")
    monkeypatch.setenv("TRAINLOOP_OPTIMIZER__LR", "fast")
    code, _, err = call(capsys, "validate", "run.json", "--trainer", TRAINER)
    assert code == 2
    assert err.splitlines() == [
        "trainloop validate: error: TRAINLOOP_OPTIMIZER__LR: optimizer.lr: Input should be a valid number (got 'fast')",
        "trainloop validate: error: run.json: hooks[0].exit_code: Input should be '128+signal' or less than or "
        "equal to 255 (got 300)",
    ]


def test_the_settings_file_names_its_trainer(launched):
    process, root = launched["run_named"]
    result = process.result()
    assert result.returncode == 0, result.stderr
    assert json.loads((root / "ws" / "settings.json").read_text())["trainer"] == TRAINER


def test_train_runs_the_same_preflight_before_writing(tmp_path):
    settings = TrainerSettings.model_validate({**DOOMED, "workspace": str(tmp_path / "ws")})
    with pytest.raises(PreflightError) as info:
        TinyTrainer(settings).train()
    assert info.value.problems == [line.removeprefix("run.json: ").replace("CliTrainer", "TinyTrainer") for line in DOOMED_LINES]
    assert not (tmp_path / "ws").exists()


def test_validate_without_trainer_checks_what_settings_alone_tell(tmp_path, capsys):
    (tmp_path / "run.json").write_text(json.dumps(DOOMED))
    code, out, err = call(capsys, "validate", "run.json")
    assert code == 2
    assert out == ""
    # No trainer named: the method cannot be checked; the checkpoint directory can.
    assert err.splitlines() == [f"trainloop validate: error: {DOOMED_LINES[1]}"]


def test_a_trainer_without_its_methods_is_reported_at_once(tmp_path, capsys):
    (tmp_path / "bare.py").write_text("from trainloop import BaseTrainer\nclass Bare(BaseTrainer):\n    pass\n")
    (tmp_path / "run.json").write_text('{"max_steps": 2}')
    code, _, err = call(capsys, "validate", "run.json", "--trainer", "bare:Bare")
    assert code == 2
    assert err.splitlines() == [
        "trainloop validate: error: run.json: Bare must implement build_data_loader()",
        "trainloop validate: error: run.json: Bare must implement build_model()",
        "trainloop validate: error: run.json: Bare must implement forward()",
        "trainloop validate: error: run.json: optimizer: none declared, and Bare does not implement build_optimizer()",
    ]


@pytest.mark.parametrize(
    ("hooks", "problem"),
    [
        (
            [{"type": "checkpointing", "interval": 2}, {"type": "checkpointing", "interval": 5, "path": "more"}],
            "hooks[0] and hooks[1]: each would load a checkpoint into the trainer; set load to null on all but one",
        ),
        (
            [{"type": "checkpointing", "interval": 2}, {"type": "checkpointing", "interval": 5, "load": None}],
            "hooks[0] and hooks[1]: both write checkpoints to ",
        ),
        (
            [
                {"type": "checkpointing", "interval": 2, "exit_signals": ["SIGTERM"]},
                {"type": "checkpointing", "interval": 5, "path": "b", "load": None, "exit_signals": [15]},
            ],
            "hooks[0] and hooks[1]: each catches SIGTERM, and a process has one handler per signal",
        ),
    ],
)
def test_hook_combinations_that_cannot_work(tmp_path, hooks, problem):
    settings = TrainerSettings(max_steps=2, workspace=tmp_path, hooks=hooks)
    (found,) = preflight(settings, TinyTrainer)
    assert found.startswith(problem)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_a_device_this_machine_lacks():
    assert preflight(TrainerSettings(max_steps=1, device="cuda:0")) == [
        "device: 'cuda:0', but CUDA is not available on this machine"
    ]


def test_evaluate_may_be_an_instance_attribute_when_train_checks(tmp_path):
    class WithEvaluate(TinyTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.check = lambda: {"loss": 0.0}

    settings = TrainerSettings(max_steps=2, hooks=[{"type": "validation", "evaluate": "check", "interval": 1}])
    assert preflight(settings, WithEvaluate)  # the class alone does not have it...
    trainer = WithEvaluate(settings)
    trainer.train()  # ...the instance does
    assert trainer.hooks[0].last_records == {"loss": 0.0}


def test_under_a_launcher_the_checkpoint_directory_is_left_to_the_hook(monkeypatch, tmp_path):
    # Each rank runs the preflight alone; a file check could differ between ranks.
    settings = TrainerSettings(max_steps=2, workspace=tmp_path, hooks=[{"type": "checkpointing", "interval": 1, "load": "absent"}])
    assert preflight(settings) == ["hooks[0].load: no checkpoint directory at 'absent'"]
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert preflight(settings) == []


@pytest.mark.parametrize("command", ["run", "validate"])
def test_two_declared_hooks_saving_state_under_one_name_are_refused(tmp_path, capsys, command):
    (tmp_path / "run.json").write_text(json.dumps({"max_steps": 2, "workspace": "ws", "hooks": [{"type": "ema"}, {"type": "ema", "decay": 0.5}]}))
    code, out, err = call(capsys, command, "run.json", "--trainer", TRAINER)
    assert code == 2
    assert out == ""
    assert err.splitlines() == [f"trainloop {command}: error: run.json: hooks[0] and hooks[1]: both save their state under the name 'ema_hook'; give each a \"name\""]
    assert [p.name for p in tmp_path.iterdir()] == ["run.json"]


def test_a_registered_hook_tells_the_preflight_what_it_writes_and_which_signals_it_claims(tmp_path):
    # The preflight names no hook type: any registered class declares its directories and signals.
    import signal

    from trainloop.hooks import BaseHook, register_hook, unregister_hook

    class Writer(BaseHook):
        writes_to = ("out",)

        def __init__(self, out: Path, catch: bool = False) -> None:
            self.out = out

        @classmethod
        def claimed_signals(cls, declared):
            return [signal.SIGUSR2] if declared.catch else []

    register_hook("test_writer")(Writer)
    try:
        (tmp_path / "blocked").write_text("a file in the way")
        settings = TrainerSettings(
            max_steps=2,
            workspace=tmp_path,
            hooks=[
                {"type": "test_writer", "out": "blocked", "catch": True},
                {"type": "test_writer", "out": "free", "catch": True},
            ],
        )
        found = preflight(settings, TinyTrainer)
    finally:
        unregister_hook("test_writer")
    assert len(found) == 2
    assert found[0] == "hooks[0] and hooks[1]: each catches SIGUSR2, and a process has one handler per signal"
    assert found[1].startswith("hooks[0].out: ")
