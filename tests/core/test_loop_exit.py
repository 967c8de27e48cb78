"""The end of a run: every hook's ``on_after_train`` runs even when one raises (the first error is
raised), and a hook failing in ``on_exception`` never replaces the error that ended the run."""

from __future__ import annotations

import logging
import signal
import subprocess
import textwrap

import pytest
from child_process import ChildProcess
from helper_hooks import CaptureHook
from tiny_trainer import TinyTrainer

from trainloop import BaseHook, RunResult


class EndFails(BaseHook):
    """Raises from ``on_after_train`` (and, with ``on_exception``, from that too)."""

    def __init__(self, message: str, on_exception: bool = False) -> None:
        self.message, self.fail_on_exception = message, on_exception

    def on_exception(self, trainer, error):
        if self.fail_on_exception:
            raise RuntimeError(f"{self.message} in on_exception")

    def on_after_train(self, trainer):
        raise RuntimeError(self.message)


def test_every_hooks_end_runs_and_the_first_error_is_raised(caplog):
    after = CaptureHook()
    trainer = TinyTrainer(max_steps=2, hooks=[EndFails("first"), EndFails("second"), after])
    with caplog.at_level(logging.ERROR, logger="trainloop"), pytest.raises(RuntimeError) as raised:
        trainer.train()
    assert raised.value.args == ("first",)
    assert after.events("on_after_train") == [("on_after_train", "exiting", 2)]
    assert "second" in caplog.text  # the later error is not lost either
    assert isinstance(trainer.result, RunResult)
    assert trainer.result.error == "RuntimeError: first"


def test_a_hook_failing_in_on_exception_does_not_replace_the_runs_error(caplog):
    class Boom(TinyTrainer):
        def forward(self, batch):
            if self.step == 2:
                raise ValueError("the user's error")
            return super().forward(batch)

    after = CaptureHook()
    trainer = Boom(max_steps=5, hooks=[EndFails("hook", on_exception=True), after])
    with caplog.at_level(logging.ERROR, logger="trainloop"), pytest.raises(ValueError, match="the user's error") as raised:
        trainer.train()
    # Both hooks ran both methods; the hooks' errors are logged and noted on the user's error.
    assert [c[0] for c in after.calls[-2:]] == ["on_exception", "on_after_train"]
    assert "hook in on_exception" in caplog.text
    assert "RuntimeError('hook')" in caplog.text
    assert any("hook in on_exception" in note for note in raised.value.__notes__)
    assert trainer.result.error == "ValueError: the user's error"


CHILD = textwrap.dedent(
    """
    import sys
    from tiny_trainer import TinyTrainer
    from trainloop import BaseHook, CheckpointingHook

    class EndFails(BaseHook):
        def on_after_train(self, trainer):
            raise RuntimeError("end failed")

    # The failing hook first: CheckpointingHook's on_after_train, which gives SIGTERM back to
    # its previous handler, comes after it.
    hooks = [EndFails(), CheckpointingHook(interval=100)]
    try:
        TinyTrainer(max_steps=2, workspace=sys.argv[1], hooks=hooks).train()
    except RuntimeError as error:
        print("caught", error, flush=True)
    sys.stdin.readline()  # a process that lives on after train(), as a notebook or a server does
    print("still alive", flush=True)
    """
)


def test_after_a_failing_end_sigterm_kills_the_process_again(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    child = ChildProcess(script, [str(tmp_path / "ws")], tmp_path)
    try:
        assert child.wait_for("caught") == "caught end failed"
        child.proc.send_signal(signal.SIGTERM)
        try:
            code = child.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail("SIGTERM was ignored after train() returned: a hook's signal handler is still installed")
        assert code == -signal.SIGTERM
    finally:
        if child.proc.poll() is None:
            child.proc.kill()


class Stopped(Exception):
    pass


def test_an_error_from_an_on_exit_callback_still_ends_the_run_through_every_hooks_end(tmp_path):
    # Leaving the failing state runs its on_exit callbacks again: the one that raised raises again.
    # The run's error is still the first, and every hook ends (the checkpoint location is given back).
    from trainloop.hooks import CheckpointingHook

    def make():
        capture = CaptureHook()
        trainer = TinyTrainer(max_steps=4, workspace=tmp_path / "ws",
                              hooks=[capture, CheckpointingHook(interval=2, path=tmp_path / "checkpoints")])
        return trainer, capture

    trainer, capture = make()
    first = Stopped("after the save of step 2")

    def stop(t):
        if t.step == 2:
            raise first

    trainer.on_exit("checkpointing", stop)
    with pytest.raises(Stopped) as raised:
        trainer.train()
    assert raised.value is first
    assert capture.error is first
    assert [event for event, _, _ in capture.calls][-2:] == ["on_exception", "on_after_train"]
    assert trainer.state.value == "exiting"
    again, _ = make()  # the location is free again: the next run resumes from step 2's checkpoint
    again.train()
    assert again.step == 4
