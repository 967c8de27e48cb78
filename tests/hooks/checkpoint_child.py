"""A training run that tests/hooks/test_checkpointing.py starts as a subprocess, to signal or kill.

Needs ``tests/`` and the repository root on ``PYTHONPATH``. Prints one line per event, flushed,
so the parent can time its signal:

    started <step>           after any checkpoint was loaded (in on_before_train)
    step <step>              after each step
    saving <step>            as a save begins (before CheckpointingHook writes)
    exiting <state> <step>   in on_after_train

    forked <pid>             (save-loop) a run began in process <pid>, to be killed
    reaped <pid> <code>      (save-loop) that process has ended (-9: by SIGKILL)

Modes:
    signal <workspace> <max_steps>   sleeps a little per step; saves only at the end or on SIGTERM
    save-loop <workspace>            for each line read from stdin, forks a run that saves a
                                     ~16 MB checkpoint every step, endlessly, and waits for it to
                                     be killed (forking spares a second torch import per run)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from tiny_trainer import TinyTrainer

from trainloop import BaseHook
from trainloop.hooks.checkpointing import CheckpointingHook


class ReportHook(BaseHook):
    """Prints the events the parent waits for; optionally sleeps at each step so a signal lands mid-run."""

    def __init__(self, sleep: float = 0.0) -> None:
        self.sleep = sleep

    def _say(self, *words: object) -> None:
        print(*words, flush=True)

    def on_before_train(self, trainer):
        self._say("started", trainer.step)

    def on_before_step(self, trainer):
        if self.sleep:
            time.sleep(self.sleep)

    def on_after_step(self, trainer):
        self._say("step", trainer.step)

    def on_enter_checkpointing(self, trainer):
        self._say("saving", trainer.step)

    def on_after_train(self, trainer):
        self._say("exiting", trainer.state.value, trainer.step)


class BallastHook(BaseHook):
    """Adds a large tensor to every checkpoint, so that a save takes long enough to be killed in."""

    def __init__(self, numel: int = 4 * 1024 * 1024) -> None:
        self.weights = torch.arange(numel, dtype=torch.float32)

    def on_state_dict(self, trainer, state_dict):
        state_dict[self.name] = {"weights": self.weights, "step": trainer.step}


def fork_save_loops(workspace: str) -> None:
    """Per line on stdin, run the save loop in a forked process and report its pid and its end."""
    while sys.stdin.readline():
        pid = os.fork()
        if pid == 0:
            try:
                hooks = [BallastHook(), ReportHook(), CheckpointingHook(interval=1, keep_previous=1)]
                TinyTrainer(max_steps=1_000_000, workspace=workspace, hooks=hooks).train()
            finally:
                os._exit(1)  # only reached if the run was not killed
        print("forked", pid, flush=True)
        _, status = os.waitpid(pid, 0)
        print("reaped", pid, os.waitstatus_to_exitcode(status), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["signal", "save-loop"])
    parser.add_argument("workspace")
    parser.add_argument("max_steps", type=int, nargs="?", default=1_000_000)
    args = parser.parse_args()
    if args.mode == "save-loop":
        fork_save_loops(args.workspace)
        return
    hooks = [ReportHook(sleep=0.05), CheckpointingHook(interval=1_000_000, exit_signals=["SIGTERM"])]
    TinyTrainer(max_steps=args.max_steps, workspace=args.workspace, hooks=hooks).train()


if __name__ == "__main__":
    main()
