"""The signals that end a run cleanly (preemption, Ctrl-C), caught for the duration of a run.

A scheduler that preempts a job sends SIGTERM (Kubernetes, torchrun forwarding its own), or the
signal ``sbatch --signal`` names (SIGUSR1 here by convention); a person presses Ctrl-C
(SIGINT). The first such signal is only recorded: the step in progress finishes, the run saves
and exits with ``128 + signal``. A SIGINT after that means "now": the process ends at once with
code 130 (``128 + SIGINT``), saying so in one line, whatever it is doing (a save, a wait for a
background save, another hook's exit): no exception is raised that code on the way could catch,
turn into another error or print as a traceback, and no thread is waited for. Checkpoints are
written atomically, so the save given up leaves at most a hidden leftover, removed by the next
save or load. Any other repeated signal is ignored until the run has exited, so a scheduler that
signals twice does not kill the exit save.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from types import FrameType
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import AfterValidator, Field, StrictInt, StrictStr

if TYPE_CHECKING:
    from logging import Logger

    from trainloop.core.run_state import TrainerView

__all__ = [
    "DEFAULT_EXIT_SIGNALS",
    "INTERRUPTED_EXIT_CODE",
    "ExitCode",
    "ExitOnSignal",
    "ExitSignal",
    "ExitSignals",
    "as_signal",
]


DEFAULT_EXIT_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT")
"""What a ``CheckpointingHook`` catches unless told otherwise."""

INTERRUPTED_EXIT_CODE = 128 + signal.SIGINT
"""The exit code of a second Ctrl-C (130, a shell's code for SIGINT)."""


def as_signal(value: str | int) -> signal.Signals:
    """A signal name (``"SIGTERM"``, ``"TERM"``) or number as a ``signal.Signals``.

    Raises:
        ValueError: It names no signal, or one that cannot be caught.
    """
    try:
        if isinstance(value, str):
            name = value.upper()
            found = signal.Signals[name if name.startswith("SIG") else f"SIG{name}"]
        else:
            found = signal.Signals(value)
    except (KeyError, ValueError):
        raise ValueError(f"not a signal: {value!r} (give a name such as 'SIGTERM', or a number)") from None
    if found in (signal.SIGKILL, signal.SIGSTOP):
        raise ValueError(f"{found.name} cannot be caught")
    return found


class ExitSignals:
    """Installs handlers for ``signals`` during a run and records the first one caught.

    Args:
        signals: The signals to catch.
        required: Whether failing to install them (outside the main thread, where Python
            cannot) is an error; else it is logged and the run goes on without them.
        name: Who asked, for messages (e.g. ``"CheckpointingHook exit_signals"``).
    """

    def __init__(self, signals: tuple[signal.Signals, ...], required: bool, name: str) -> None:
        self.signals = signals
        self.required = required
        self.name = name
        self.caught: signal.Signals | None = None
        self.caught_at: float | None = None  # time.monotonic() of the first signal
        self._previous: dict[signal.Signals, Any] = {}
        self._logger = logging.getLogger("trainloop")

    def install(self, logger: logging.Logger) -> None:
        """Catch the signals from now on (the previous handlers are kept for :meth:`restore`).

        Raises:
            RuntimeError: Not in the main thread, and the signals were asked for explicitly.
        """
        self.caught, self.caught_at = None, None
        self._logger = logger
        if not self.signals:
            return
        if threading.current_thread() is not threading.main_thread():
            message = f"{self.name} cannot be installed outside the main thread"
            if self.required:
                raise RuntimeError(f"{message}: signal only works in main thread of the main interpreter")
            logger.info("%s; the run will not save on %s", message, ", ".join(s.name for s in self.signals))
            return
        for signum in self.signals:
            # A bound method gets the signal number from the OS: no loop variable to close over.
            self._previous[signum] = signal.signal(signum, self._on_signal)

    def restore(self) -> None:
        """Give the signals back to the handlers they had before :meth:`install`."""
        while self._previous:
            signum, handler = self._previous.popitem()
            # None: the previous handler was not installed from Python; the default is closest.
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)

    def exit_code(self, setting: str | int) -> int:
        """The exit code for the signal caught: ``128 + signal`` or the fixed ``setting``."""
        assert self.caught is not None
        return 128 + self.caught if setting == "128+signal" else int(setting)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.caught is None:
            # Only record: the step in progress finishes, and the hook acts on it after the step.
            self.caught, self.caught_at = signal.Signals(signum), time.monotonic()
            return
        if signum == signal.SIGINT:
            self._logger.error(
                "Second Ctrl-C: exiting at once with code %d, without the exit checkpoint", INTERRUPTED_EXIT_CODE
            )
            _exit_now(INTERRUPTED_EXIT_CODE)
        # A repeated SIGTERM (a scheduler, torchrun) must not cut the exit save short.


def _exit_now(code: int) -> None:
    """End the process with ``code`` now, once what was logged and printed is written out."""
    logging.shutdown()  # flushes every handler
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):  # closed, or replaced by something without flush
            pass
    os._exit(code)


def _signal_name(value: str | int) -> str:
    return as_signal(value).name


ExitSignal = Annotated[StrictStr | StrictInt, AfterValidator(_signal_name)]
"""A signal name (``"SIGTERM"``, ``"TERM"``) or number, validated into its canonical name
(``"SIGTERM"``), so declared settings and the defaults compare and round-trip alike."""
ExitCode = Annotated[int, Field(ge=0, le=255, strict=True)]
"""An exit code a signal exit ends with."""


class ExitOnSignal(ExitSignals):
    """``ExitSignals`` that, once one is caught, request the run's exit (see ``ExitSignals`` for the arguments)."""

    def __init__(self, signals: tuple[signal.Signals, ...], required: bool, name: str) -> None:
        super().__init__(signals, required, name)
        self.exit_asked = False

    def install(self, logger: Logger) -> None:
        """Catch the signals from now on; no exit asked yet."""
        self.exit_asked = False
        super().install(logger)

    def request_exit(self, trainer: TrainerView, exit_code: str | int) -> None:
        """After the step during which a signal arrived, request the exit (once), saying so.

        Args:
            trainer: The trainer.
            exit_code: ``"128+signal"`` or a fixed code (``CheckpointingHook(exit_code=...)``).
        """
        caught = self.caught
        if caught is None or self.exit_asked:  # no signal, or the exit already asked
            return
        # No request_checkpoint() here: it would hold on this rank only, and a save needs
        # every rank. The standing at-exit request saves the step all ranks agree to stop at.
        self.exit_asked = True
        code = self.exit_code(exit_code)
        trainer.logger.warning(
            "Caught %s during step %d: the run saves and exits with code %d%s",
            # A repeated SIGTERM never cuts the save short; only a second Ctrl-C does.
            caught.name, trainer.step, code, " (Ctrl-C again: exit at once, without saving)"
            if caught is signal.SIGINT else "",
        )
        trainer.request_exit(code)

    def wait_before_save(self, logger: Logger, seconds: float) -> None:
        """Wait ``seconds`` (``exit_wait``) before the save of a run a signal ends."""
        if self.caught is not None and seconds > 0:
            logger.info("Waiting %.1f s (exit_wait) before the exit checkpoint", seconds)
            time.sleep(seconds)
