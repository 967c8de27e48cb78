"""What a ``CheckpointingHook`` does once an exit signal is caught: request the exit, then wait before the last save.

Catching the signals (handlers installed for the run, the first one recorded, a second Ctrl-C)
is ``trainloop.exit_signals``'s. After the step during which a signal arrived, the hook asks the
run to exit with the signal's exit code, once; the save of the step every rank agrees to stop at
comes from the hook's standing at-exit request, and may first wait ``exit_wait`` seconds.
"""

from __future__ import annotations

import signal
import time
from typing import TYPE_CHECKING

from trainloop.exit_signals import ExitSignals

if TYPE_CHECKING:
    from logging import Logger

    from trainloop.run_state import TrainerView

__all__ = ["ExitOnSignal"]


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
