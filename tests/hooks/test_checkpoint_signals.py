"""Preemption as users meet it, with real signals to a real process: a declared CheckpointingHook
catches SIGTERM, SIGUSR1 (``sbatch --signal``) and Ctrl-C by default; a repeated SIGTERM does not
kill the exit save; a second Ctrl-C exits at once with 130, saying so in one line, whenever it comes.

The children (``checkpoint_child.py preempt``) start together, since each pays for importing
torch; their exit save pauses on a stdin line, so a second signal lands while it is in flight.
"""

from __future__ import annotations

import signal
import threading
import time

import pytest
from checkpoint_child import Child
from tiny_trainer import TinyTrainer

from trainloop.checkpoint import checkpoint_steps, read_checkpoint
from trainloop.hooks.checkpointing import CheckpointingHook

#: name: (first signal, whether the exit save runs in the background)
CASES = {
    "term_twice_async": (signal.SIGTERM, True),
    "usr1": (signal.SIGUSR1, False),
    "int_once": (signal.SIGINT, False),
    # A second Ctrl-C at several moments: 20 ms after the first (during the step that caught it,
    # before the exit save), while the save is written, while the end of the run waits for a
    # save written in the background.
    "int_twice_quickly": (signal.SIGINT, False),
    "int_twice": (signal.SIGINT, False),
    "int_twice_async": (signal.SIGINT, True),
}


def stepped(child: Child) -> int:
    """The last step the child reported."""
    return max(int(line.split()[1]) for line in child.lines if line.startswith("step "))


def signal_again(name: str, child: Child) -> str | None:
    """After the first signal: the second one, at the moment case ``name`` says; the exit save's step, if it began."""
    if name == "int_twice_quickly":
        time.sleep(0.02)  # apart: two signals before the handler runs would be one
        child.proc.send_signal(signal.SIGINT)
        return None
    writing = child.wait_for("writing")
    if name in ("term_twice_async", "int_twice_async"):
        # The end of the run waits for the background write. The write's thread and the main
        # thread print concurrently: "settling" may already have come before "writing".
        if "settling" not in child.lines:
            child.wait_for("settling")
        child.proc.send_signal(signal.SIGTERM if name == "term_twice_async" else signal.SIGINT)
    elif name == "int_twice":
        child.proc.send_signal(signal.SIGINT)  # while the exit save is under way
    if name not in ("int_twice", "int_twice_async"):
        child.send("")  # let the write go on
    return writing.split()[1]


@pytest.fixture(scope="module")
def preempted(tmp_path_factory):
    """Every case's child, stopped as its name says; per case: code, lines, stderr, workspace."""
    tmp = tmp_path_factory.mktemp("preempt")
    children = {
        name: Child(tmp, "preempt", str(tmp / name), str(int(background))) for name, (_, background) in CASES.items()
    }
    results = {}
    try:
        for name, child in children.items():
            child.wait_for("step", count=2)
            child.proc.send_signal(CASES[name][0])
            saved = signal_again(name, child)
            results[name] = {
                "code": child.finish(), "lines": child.lines, "stderr": child.stderr(),
                "root": tmp / name / "checkpoints", "saved_step": None if saved is None else int(saved),
            }
    finally:
        for child in children.values():
            if child.proc.poll() is None:
                child.proc.kill()
    return results


def assert_saved_at_exit(result) -> None:
    root, step = result["root"], result["saved_step"]
    assert checkpoint_steps(root) == [step]
    assert sorted(p.name for p in root.iterdir()) == [str(step), "latest"]  # nothing hidden left
    assert read_checkpoint(root / "latest")["training_state"]["step"] == step
    assert f"exiting exiting {step}" in result["lines"]  # `exiting` ran before the process exited


def test_a_second_sigterm_during_the_background_exit_save_does_not_lose_it(preempted):
    result = preempted["term_twice_async"]
    assert result["code"] == 128 + signal.SIGTERM, result["stderr"]
    assert_saved_at_exit(result)


def test_sigusr1_is_caught_by_default_saves_and_exits_138(preempted):
    result = preempted["usr1"]
    assert result["code"] == 128 + signal.SIGUSR1 == 138, result["stderr"]
    assert_saved_at_exit(result)
    assert "Caught SIGUSR1 during step" in result["stderr"]
    assert "Ctrl-C" not in result["stderr"]  # a scheduler's signal is not a keyboard's


def test_the_first_ctrl_c_saves_and_exits_130_telling_how_to_exit_at_once(preempted):
    result = preempted["int_once"]
    assert result["code"] == 130, result["stderr"]
    assert_saved_at_exit(result)
    assert "Caught SIGINT during step" in result["stderr"]
    assert "(Ctrl-C again: exit at once, without saving)" in result["stderr"]


@pytest.mark.parametrize("case", ["int_twice_quickly", "int_twice", "int_twice_async"])
def test_a_second_ctrl_c_exits_at_once_with_130_saying_so_never_a_traceback(preempted, case):
    result = preempted[case]
    assert result["code"] == 130, result["stderr"]
    assert "Second Ctrl-C: exiting at once with code 130, without the exit checkpoint" in result["stderr"]
    assert "Traceback" not in result["stderr"]
    assert "KeyboardInterrupt" not in result["stderr"]
    root = result["root"]
    # No checkpoint; the location's lock is left as a killed run's is (the next run takes it over).
    assert not root.exists() or [p.name for p in root.iterdir() if not p.name.startswith(".")] in ([], ["run.lock"])
    # At once: the write in flight was not waited for (it never ends here); in the foreground,
    # where the save comes before the end of the run, no hook's exit ran.
    if case != "int_twice_async":
        assert not any(line.startswith("exiting") for line in result["lines"])


# -- in process: what is installed, and where -----------------------------------------------------


def test_default_signals_are_installed_for_the_run_only(tmp_path):
    seen = {}

    class Look(CheckpointingHook):
        def on_after_step(self, trainer):
            seen.update({s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)})
            super().on_after_step(trainer)

    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    hook = Look(interval=10)
    assert hook.exit_signals == (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
    TinyTrainer(max_steps=1, workspace=tmp_path, hooks=[hook]).train()
    assert all(seen[s] != before[s] for s in before)
    assert {s: signal.getsignal(s) for s in before} == before
    assert CheckpointingHook(interval=1, exit_signals=[]).exit_signals == ()
    assert CheckpointingHook(interval=1, exit_signals=None).exit_signals == ()


def test_default_signals_outside_the_main_thread_are_skipped_not_an_error(tmp_path, caplog):
    errors = []

    def train():
        try:
            TinyTrainer(max_steps=2, workspace=tmp_path, hooks=[CheckpointingHook(interval=1)]).train()
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    with caplog.at_level("INFO", logger="trainloop"):
        thread = threading.Thread(target=train)
        thread.start()
        thread.join()
    assert errors == []
    assert "cannot be installed outside the main thread; the run will not save on SIGTERM, SIGUSR1, SIGINT" in caplog.text
    assert checkpoint_steps(tmp_path / "checkpoints") == [2]
