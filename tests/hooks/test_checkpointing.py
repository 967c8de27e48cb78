"""CheckpointingHook: layout, pruning, resuming, safe loading, signals, parameters.

Formats and background saves: test_checkpoint_formats.py; manifest, save failures and SIGKILL
mid-save: test_checkpoint_integrity.py.
"""

from __future__ import annotations

import builtins
import logging
import os
import signal
import subprocess
import threading
from pathlib import Path

import pytest
import torch
from checkpoint_child import Child
from helper_hooks import CaptureHook, CounterHook, SaveRecorder, SignalAtStep
from pydantic import ValidationError
from tiny_trainer import TinyTrainer

from trainloop import BaseHook
from trainloop.checkpoint import CheckpointError, checkpoint_steps, latest_checkpoint, read_checkpoint
from trainloop.checkpoint.manifest import write_manifest
from trainloop.hook_machinery.registry import HOOK_TYPES, hook_settings_model
from trainloop.hooks.checkpointing import CheckpointingHook

# -- helpers ---------------------------------------------------------------------------------


class MomentumTrainer(TinyTrainer):
    """TinyTrainer with optimizer and scheduler state, so a resume has something to restore."""

    def build_optimizer(self):
        return torch.optim.SGD(self.model.parameters(), lr=self.lr, momentum=0.9)

    def build_lr_scheduler(self):
        return torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=5, gamma=0.5)


class Evil:
    """Unpickling this opens (creates) ``marker``: what a hostile checkpoint would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (builtins.open, (str(self.marker), "w"))


def hidden_entries(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("."))


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def run(tmp_path: Path, max_steps: int, *hooks: BaseHook, trainer_class=TinyTrainer, **kwargs) -> TinyTrainer:
    trainer = trainer_class(max_steps=max_steps, workspace=tmp_path, hooks=list(hooks), **kwargs)
    trainer.train()
    return trainer


# -- layout, schedule, pruning ---------------------------------------------------------------


def test_layout_files_and_latest_symlink(tmp_path):
    counter = CounterHook()
    run(tmp_path, 5, counter, CheckpointingHook(interval=2, keep_previous=10))
    root = tmp_path / "checkpoints"
    assert checkpoint_steps(root) == [2, 4, 5]  # every 2 steps, and the last one
    for step in (2, 4, 5):
        assert sorted(p.name for p in (root / str(step)).iterdir()) == [
            "counter_hook.pt", "manifest.json", "metadata.json", "model.pt", "training_state.pt"
        ]
        state = read_checkpoint(root / str(step))
        assert state["training_state"]["step"] == step
        assert state["counter_hook"] == {"count": step}
    latest = root / "latest"
    assert latest.is_symlink()
    assert os.readlink(latest) == "5"  # relative: the tree can move
    assert latest_checkpoint(root) == (root / "5").resolve()
    assert hidden_entries(root) == []
    latest.unlink()  # without the symlink, the highest step is the newest
    assert latest_checkpoint(root) == root / "5"
    assert latest_checkpoint(tmp_path / "nothing") is None


def test_absolute_path_and_relative_path_without_workspace(tmp_path):
    trainer = TinyTrainer(max_steps=2, hooks=[CheckpointingHook(interval=1, path=tmp_path / "abs")])
    trainer.train()
    assert checkpoint_steps(tmp_path / "abs") == [2]
    trainer = TinyTrainer(max_steps=2, hooks=[CheckpointingHook(interval=1, path="rel")])
    with pytest.raises(ValueError, match=r"path='rel' is relative but the trainer has no workspace"):
        trainer.train()


def test_schedule_and_pruning_keep_previous_interval_and_steps(tmp_path):
    recorder = SaveRecorder()
    hook = CheckpointingHook(interval=4, keep_interval=5, keep_steps=[3])
    run(tmp_path, 11, recorder, hook)
    # due: interval multiples (4, 8), keep_interval multiples (5, 10), keep_steps (3), last (11)
    assert recorder.saved == [3, 4, 5, 8, 10, 11]
    assert checkpoint_steps(tmp_path / "checkpoints") == [3, 5, 10, 11]  # keep_previous=0

    other = tmp_path / "other"
    hook = CheckpointingHook(interval=1, keep_previous=2, keep_interval=5, keep_steps=[3, 7], path=other)
    run(tmp_path, 12, hook)
    assert checkpoint_steps(other) == [3, 5, 7, 10, 11, 12]
    assert os.readlink(other / "latest") == "12"
    assert hidden_entries(other) == []


def test_prune_failure_is_logged_not_raised(tmp_path, caplog):
    root = tmp_path / "checkpoints"
    run(tmp_path, 2, CheckpointingHook(interval=1, keep_previous=5))
    stuck = root / "1" / "stuck"
    stuck.write_text("cannot be deleted")
    undo = _make_undeletable(stuck)
    try:
        with caplog.at_level(logging.WARNING, logger="trainloop"):
            run(tmp_path, 4, CheckpointingHook(interval=1, keep_previous=1))
        assert "Could not remove old checkpoint" in caplog.text
        assert str(root / "1") in caplog.text
        assert checkpoint_steps(root) == [3, 4]  # "1" left its name at once; the rest pruned
        assert os.readlink(root / "latest") == "4"
    finally:
        undo()


def _make_undeletable(path: Path):
    """Make ``path`` impossible to delete for this process; return the undo."""
    if os.geteuid() != 0:
        path.parent.chmod(0o500)
        return lambda: _chmod_all(path.parents[1], 0o700)
    result = subprocess.run(["chattr", "+i", str(path)], capture_output=True, check=False)
    if result.returncode != 0:
        pytest.skip(f"cannot make a file undeletable as root here: {result.stderr!r}")
    return lambda: _chattr_all(path.parents[1])


def _chattr_all(root: Path) -> None:
    for p in root.rglob("stuck"):
        subprocess.run(["chattr", "-i", str(p)], check=True)


def _chmod_all(root: Path, mode: int) -> None:
    for p in root.rglob("*"):
        if p.is_dir():
            p.chmod(mode)


def test_resaving_an_existing_step_replaces_it(tmp_path):
    run(tmp_path, 4, CheckpointingHook(interval=2, keep_previous=1, load=None), lr=0.05)
    root = tmp_path / "checkpoints"
    first = read_checkpoint(root / "4")["model"]
    trainer = run(tmp_path, 4, CheckpointingHook(interval=2, keep_previous=1, load=None), lr=0.2)
    second = read_checkpoint(root / "4")["model"]
    assert checkpoint_steps(root) == [2, 4]
    assert all(torch.equal(second[k], v) for k, v in params(trainer.model).items())
    assert not torch.equal(first["0.weight"], second["0.weight"])
    assert hidden_entries(root) == []


def test_state_dict_key_that_cannot_name_a_file(tmp_path):
    class BadKey(BaseHook):
        def on_state_dict(self, trainer, state_dict):
            state_dict["a/b"] = 1

    with pytest.raises(ValueError, match=r"'a/b' cannot name a checkpoint file"):
        run(tmp_path, 1, BadKey(), CheckpointingHook(interval=1))
    assert checkpoint_steps(tmp_path / "checkpoints") == []


# -- resuming --------------------------------------------------------------------------------


def test_resume_continues_and_matches_an_uninterrupted_run(tmp_path):
    straight = run(tmp_path / "straight", 16, trainer_class=MomentumTrainer)

    counter = CounterHook()
    run(tmp_path / "split", 8, counter, CheckpointingHook(interval=8), trainer_class=MomentumTrainer)
    capture, counter = CaptureHook(), CounterHook()
    resumed = run(tmp_path / "split", 16, capture, counter, CheckpointingHook(interval=8),
                  trainer_class=MomentumTrainer)

    assert capture.events("on_before_train") == [("on_before_train", "restoring", 8)]
    assert [c[2] for c in capture.events("on_after_step")] == list(range(9, 17))
    assert counter.count == 16  # hook state came back too
    assert resumed.lr_scheduler.state_dict() == straight.lr_scheduler.state_dict()
    for key, value in params(straight.model).items():
        torch.testing.assert_close(resumed.model.state_dict()[key], value, rtol=0, atol=0)


def test_load_path_and_missing_path(tmp_path):
    run(tmp_path, 8, CheckpointingHook(interval=4, keep_previous=1))
    capture = CaptureHook()
    chosen = tmp_path / "checkpoints" / "4"
    run(tmp_path / "elsewhere", 6, capture, CheckpointingHook(interval=100, load=chosen))
    assert capture.events("on_before_train")[0][2] == 4
    assert checkpoint_steps(tmp_path / "elsewhere" / "checkpoints") == [6]

    missing = tmp_path / "no" / "such"
    hook = CheckpointingHook(interval=1, load=missing)
    trainer = TinyTrainer(max_steps=2, workspace=tmp_path, hooks=[hook])
    with pytest.raises(FileNotFoundError, match=str(missing)):
        trainer.train()


def test_load_none_ignores_existing_checkpoints_and_latest_with_none_starts_fresh(tmp_path):
    run(tmp_path, 3, CheckpointingHook(interval=1))
    capture = CaptureHook()
    run(tmp_path, 2, capture, CheckpointingHook(interval=1, load=None))
    assert capture.events("on_before_train")[0][2] == 0
    capture = CaptureHook()
    run(tmp_path / "empty", 2, capture, CheckpointingHook(interval=1))
    assert capture.events("on_before_train")[0][2] == 0


def test_a_latest_link_into_another_runs_checkpoints_is_skipped_with_a_warning(tmp_path, caplog):
    # Run "other" reached step 6; this run saved steps 1 and 2, then its latest was pointed at
    # the other run's step 6 (a copied workspace, a hand-made link). Followed, it would resume
    # the other run's weights at step 6 and, with keep_previous=0, prune its own 1 and 2.
    run(tmp_path / "other", 6, CheckpointingHook(interval=3))
    run(tmp_path / "mine", 2, CheckpointingHook(interval=1, keep_previous=1))
    root = tmp_path / "mine" / "checkpoints"
    (root / "latest").unlink()
    (root / "latest").symlink_to(Path("..", "..", "other", "checkpoints", "6"))

    capture = CaptureHook()
    with caplog.at_level(logging.WARNING, logger="trainloop"):
        run(tmp_path / "mine", 3, capture, CheckpointingHook(interval=1, keep_previous=0))
    assert capture.events("on_before_train") == [("on_before_train", "restoring", 2)]  # its own newest
    assert f"Ignoring {root / 'latest'}: it points to {tmp_path / 'other' / 'checkpoints' / '6'}" in caplog.text
    assert checkpoint_steps(root) == [3]
    assert (root / "latest").resolve() == root / "3"
    assert checkpoint_steps(tmp_path / "other" / "checkpoints") == [6]  # the other run untouched


def test_resuming_with_another_optimizer_class_names_both(tmp_path):
    # SGD with momentum saved, AdamW built: torch loads the state and fails in AdamW's first
    # step with a bare KeyError: 'step'. The resume itself must say what does not match.
    class AdamWTrainer(TinyTrainer):
        def build_optimizer(self):
            return torch.optim.AdamW(self.model.parameters(), lr=1e-3)

    run(tmp_path, 2, CheckpointingHook(interval=2), trainer_class=MomentumTrainer)
    capture = CaptureHook()
    with pytest.raises(ValueError, match=r"saved by torch\.optim\.sgd\.SGD, and this run's optimizer is torch\.optim\.adamw\.AdamW"):
        run(tmp_path, 4, capture, CheckpointingHook(interval=2), trainer_class=AdamWTrainer)
    assert capture.events("on_before_step") == []  # refused while restoring, before any step


@pytest.mark.parametrize("file", ["training_state.pt", "extra_hook.pt"])
def test_code_in_a_checkpoint_file_is_refused(tmp_path, file):
    run(tmp_path, 2, CheckpointingHook(interval=2))
    target = tmp_path / "checkpoints" / "2" / file
    marker = tmp_path / "pwned"
    torch.save({"step": 2, "payload": Evil(marker)}, target)
    write_manifest(target.parent)  # a hostile checkpoint comes with a manifest that matches
    trainer = TinyTrainer(max_steps=3, workspace=tmp_path, hooks=[CheckpointingHook(interval=1)])
    with pytest.raises(CheckpointError, match="refused to load") as error:
        trainer.train()
    assert str(target) in str(error.value)
    assert "builtins.open" in str(error.value) or "io.open" in str(error.value)
    assert not marker.exists()


def test_incomplete_or_corrupt_checkpoint_errors_name_the_file(tmp_path):
    run(tmp_path, 2, CheckpointingHook(interval=2))
    directory = tmp_path / "checkpoints" / "2"
    model = directory / "model.pt"
    model.write_bytes(model.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=rf"{model}: cannot load: truncated"):
        read_checkpoint(directory)
    write_manifest(directory)  # the manifest agrees now: torch itself finds the file cut short
    with pytest.raises(CheckpointError, match=rf"{model}: cannot load: "):
        read_checkpoint(directory)
    model.unlink()
    with pytest.raises(CheckpointError, match=r"not a complete checkpoint: missing model\.pt"):
        read_checkpoint(directory)
    write_manifest(directory)
    with pytest.raises(CheckpointError, match=r"not a complete checkpoint: missing model\.pt"):
        read_checkpoint(directory)


# -- crashes mid-save: the states a crash can leave, recovered by the next run -----------------


def test_interrupted_replacement_is_rolled_back_and_leftovers_cleaned(tmp_path):
    run(tmp_path, 3, CheckpointingHook(interval=1, keep_previous=5))
    root = tmp_path / "checkpoints"
    expected = read_checkpoint(root / "3")["model"]
    # A crash while re-saving step 3: the old "3" is moved aside, the new one not yet renamed
    # in (so latest dangles), a symlink update and a prune were also cut short.
    os.rename(root / "3", root / ".3.old-0123abcd")
    (root / ".3.tmp-89abcdef").mkdir()
    (root / ".3.tmp-89abcdef" / "model.pt").write_bytes(b"half")
    os.symlink("2", root / ".latest.tmp-0000beef")
    (root / ".1.del-deadbeef").mkdir()
    assert not (root / "latest").exists()

    capture = CaptureHook()
    trainer = run(tmp_path, 4, capture, CheckpointingHook(interval=1, keep_previous=5))
    assert capture.events("on_before_train")[0][2] == 3  # the restored checkpoint was loaded
    assert hidden_entries(root) == []
    assert checkpoint_steps(root) == [1, 2, 3, 4]
    assert all(torch.equal(read_checkpoint(root / "3")["model"][k], v) for k, v in expected.items())
    assert os.readlink(root / "latest") == "4"
    assert trainer.step == 4


def test_interrupted_first_save_starts_fresh(tmp_path):
    root = tmp_path / "checkpoints"
    (root / ".1.tmp-0badc0de").mkdir(parents=True)
    (root / ".1.tmp-0badc0de" / "model.pt").write_bytes(b"half")
    capture = CaptureHook()
    run(tmp_path, 1, capture, CheckpointingHook(interval=1))
    assert capture.events("on_before_train")[0][2] == 0
    assert hidden_entries(root) == []
    assert checkpoint_steps(root) == [1]


# -- exit signals, in process ----------------------------------------------------------------


def test_signal_saves_and_exits_with_128_plus_signal_and_restores_handlers(tmp_path):
    def sentinel(signum, frame):
        raise AssertionError("the previous handler must not run during training")

    previous = signal.signal(signal.SIGUSR1, sentinel)
    try:
        capture = CaptureHook()
        # Two signals: a handler closing over a loop variable would record SIGUSR2 (exit 140).
        hook = CheckpointingHook(interval=100, exit_signals=["SIGUSR1", "usr2"])
        with pytest.raises(SystemExit) as exit:
            run(tmp_path, 50, capture, SignalAtStep(3, signal.SIGUSR1), hook)
        assert exit.value.code == 128 + signal.SIGUSR1
        assert capture.events("on_after_train") == [("on_after_train", "exiting", 3)]
        assert os.readlink(tmp_path / "checkpoints" / "latest") == "3"
        assert signal.getsignal(signal.SIGUSR1) is sentinel
        assert signal.getsignal(signal.SIGUSR2) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_signal_with_fixed_exit_code_and_wait(tmp_path):
    hook = CheckpointingHook(interval=100, exit_signals=[int(signal.SIGUSR2)], exit_code=3, exit_wait=0.01)
    with pytest.raises(SystemExit) as exit:
        run(tmp_path, 50, SignalAtStep(2, signal.SIGUSR2), hook)
    assert exit.value.code == 3
    assert checkpoint_steps(tmp_path / "checkpoints") == [2]
    assert signal.getsignal(signal.SIGUSR2) is signal.SIG_DFL


def test_exit_signals_outside_the_main_thread_is_a_clear_error(tmp_path):
    errors: list[BaseException] = []

    def train() -> None:
        try:
            run(tmp_path, 2, CheckpointingHook(interval=1, exit_signals=["SIGUSR1"]))
        except BaseException as error:  # noqa: BLE001 - whatever it is, the test inspects it
            errors.append(error)

    thread = threading.Thread(target=train)
    thread.start()
    thread.join()
    assert len(errors) == 1
    assert isinstance(errors[0], RuntimeError)
    assert "exit_signals cannot be installed" in str(errors[0])
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL


# -- parameters ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"interval": 0}, "interval"),
        ({"interval": "10"}, "interval"),
        ({"interval": 1, "keep_previous": -1}, "keep_previous"),
        ({"interval": 1, "keep_interval": -5}, "keep_interval"),
        ({"interval": 1, "keep_steps": [0]}, "keep_steps"),
        ({"interval": 1, "exit_signals": ["SIGNOPE"]}, "exit_signals"),
        ({"interval": 1, "exit_signals": ["SIGKILL"]}, "exit_signals"),
        ({"interval": 1, "exit_signals": [True]}, "exit_signals"),
        ({"interval": 1, "exit_code": 256}, "exit_code"),
        ({"interval": 1, "exit_code": "128+sig"}, "exit_code"),
        ({"interval": 1, "exit_wait": -1.0}, "exit_wait"),
        ({"interval": 1, "load": 5}, "load"),
        ({"interval": 1, "format": "torch"}, "format"),
        ({"interval": 1, "async_save": "yes"}, "async_save"),
        ({"interval": 1, "async_save": 1}, "async_save"),
        ({"interval": 1, "on_save_error": "ignore"}, "on_save_error"),
    ],
)
def test_invalid_parameters_name_the_parameter(kwargs, name):
    with pytest.raises(ValidationError) as error:
        CheckpointingHook(**kwargs)
    assert {e["loc"][0] for e in error.value.errors()} == {name}


def test_declared_in_settings():
    assert HOOK_TYPES["checkpointing"] is CheckpointingHook
    model = hook_settings_model(CheckpointingHook)
    hook = model.model_validate(
        {"type": "checkpointing", "interval": 10, "exit_signals": ["SIGTERM", 2], "load": None,
         "format": "sharded", "async_save": True, "on_save_error": "warn"}
    ).build()
    assert isinstance(hook, CheckpointingHook)
    assert hook.exit_signals == (signal.SIGTERM, signal.SIGINT)
    assert hook.load is None
    assert hook.path == Path("checkpoints")
    assert (hook.format, hook.async_save, hook.on_save_error) == ("sharded", True, "warn")
    default = model.model_validate({"type": "checkpointing", "interval": 10}).build()
    assert (default.format, default.async_save, default.on_save_error) == ("full", False, "raise")
    with pytest.raises(ValidationError, match="keep_previous"):
        model.model_validate({"type": "checkpointing", "interval": 10, "keep_previous": -1})


# -- a real subprocess: SIGTERM mid-run (SIGKILL mid-save: test_checkpoint_integrity.py) ---------


def test_sigterm_mid_run_saves_exits_143_and_resumes(tmp_path):
    workspace = tmp_path / "ws"
    child = Child(tmp_path, "signal", str(workspace), "100000")
    child.wait_for("step", count=3)
    child.proc.send_signal(signal.SIGTERM)
    assert child.finish() == 128 + signal.SIGTERM == 143, child.stderr_path.read_text()
    steps = [int(line.split()[1]) for line in child.lines if line.startswith("step")]
    last = steps[-1]
    assert 3 <= last < 100000
    assert f"saving {last}" in child.lines
    assert child.lines[-1] == f"exiting exiting {last}"  # `exiting` ran before the process exited
    root = workspace / "checkpoints"
    assert checkpoint_steps(root) == [last]
    assert os.readlink(root / "latest") == str(last)
    assert read_checkpoint(root / "latest")["training_state"]["step"] == last

    resumed = Child(tmp_path, "signal", str(workspace), str(last + 3))
    assert resumed.finish() == 0, resumed.stderr_path.read_text()
    assert resumed.lines[0] == f"started {last}"
    assert [line for line in resumed.lines if line.startswith("step")] == [
        f"step {s}" for s in range(last + 1, last + 4)
    ]
    assert resumed.lines[-1] == f"exiting exiting {last + 3}"
    assert os.readlink(root / "latest") == str(last + 3)


def test_a_built_hooks_checkpoints_path_that_is_a_file_is_refused_before_the_first_step(tmp_path):
    from tiny_trainer import TinyTrainer

    (tmp_path / "checkpoints").write_text("not a directory")
    trainer = TinyTrainer(max_steps=5, workspace=tmp_path, hooks=[CheckpointingHook(interval=4, exit_signals=[])])
    with pytest.raises(ValueError, match=r"CheckpointingHook path: .*checkpoints"):
        trainer.train()
    assert trainer.step == 0  # refused in restoring, before any step
    assert (tmp_path / "checkpoints").read_text() == "not a directory"
