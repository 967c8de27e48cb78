"""What hooks ask of a run (a checkpoint, an exit), settled at the end of a step.

Hooks read the trainer but do not steer it; their levers are these requests. The machine reads
the settled answers through its policies (``checkpoint_due``, ``should_exit``), so a request made
in ``on_after_step`` takes effect on the edges that leave that step's ``stepping``.
"""

from __future__ import annotations

from collections.abc import Callable

from trainloop.distributed.agreement import ExitAgreement

__all__ = ["RunRequests"]


class RunRequests:
    """The checkpoint and exit requests of one run.

    Attributes:
        exit_agreed: Whether the run ends after this step (on every rank, once they agreed).
        exit_code: The exit code agreed on with an exit request, or ``None``.
    """

    def __init__(self) -> None:
        self.exit_agreed = False
        self.exit_code: int | None = None
        self._checkpoint = False
        self._checkpoint_at_exit = False
        self._last_checkpoint_step: int | None = None
        self._exit = 0  # this rank's: 0 none, else 1 + exit code
        self._agreement: ExitAgreement | None = None

    def request_checkpoint(self, at_exit: bool = False) -> None:
        """A checkpoint at the end of this step, or (``at_exit``) whenever the run ends cleanly."""
        if at_exit:
            self._checkpoint_at_exit = True
        else:
            self._checkpoint = True

    def request_exit(self, exit_code: int | None = None) -> None:
        """End the run after this step (with ``exit_code``, if given; the highest asked wins)."""
        self._exit = max(self._exit, 1 + (exit_code or 0))

    def open(self) -> None:
        """Start agreeing on exit requests across ranks (a collective under a process group)."""
        self._agreement = ExitAgreement()

    def settle(self) -> None:
        """At the end of an applied update: submit this rank's exit request, read the agreement."""
        agreed = self._agreement.settle(self._exit)  # type: ignore[union-attr]
        if agreed:
            self.exit_agreed = True
            if agreed > 1:
                self.exit_code = agreed - 1

    def checkpoint_due(self, step: int, ending: Callable[[], bool]) -> bool:
        """Whether a save is due after ``step``.

        Asked for, or standing and ``ending()`` says the run ends after this step (asked only then).
        """
        return self._checkpoint or (self._checkpoint_at_exit and self._last_checkpoint_step != step and ending())

    def checkpointed(self, step: int) -> None:
        """A save of ``step`` was made: the request is met."""
        self._checkpoint = False
        self._last_checkpoint_step = step

    def close(self) -> None:
        """Wait for the agreement in flight, so no collective is left dangling at exit."""
        if self._agreement is not None:
            self._agreement.close()
