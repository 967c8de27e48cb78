"""The one "every N" rule of hooks that act periodically.

A periodic hook (stats, logging, progress, validation, checkpointing) acts after a step when
that step is a multiple of ``n`` steps (or completes a multiple of ``n`` epochs), and after the
last step of a run that ends cleanly, so the end of a run is never left out:

- a run that reaches ``max_steps`` or ``max_epochs``: ``due`` is true at its last step;
- a run that ends on an exit request (a signal, early stopping): the request is settled after
  the step's hooks ran, so ``due_at_end`` tells the hook in ``on_after_train`` that the last
  step was not acted on;
- a run that ends by an error: not acted on (other ranks may not get there).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from trainloop.run_state import TrainerView

__all__ = ["Every", "Unit"]

Unit = Literal["steps", "epochs"]


class Every:
    """Decides when a periodic hook acts; one instance per hook.

    Args:
        n: Act at every multiple of this many steps (or epochs).
        unit: ``"steps"``, or ``"epochs"``: act after the step in which every ``n``-th epoch's
            last batch is drawn.

    Attributes:
        last_step: The step at which ``due`` or ``due_at_end`` last said yes, or ``None``.
    """

    def __init__(self, n: int, unit: Unit = "steps") -> None:
        if n < 1:
            raise ValueError(f"every(n) needs n >= 1, got {n}")
        self.n = n
        self.unit = unit
        self.last_step: int | None = None
        self._epochs: int | None = None  # epochs completed after the last step seen
        self._stepped = False  # a step finished in this run

    def start(self, trainer: TrainerView) -> None:
        """Begin a run (call it in ``on_before_train``): epochs are counted from its start."""
        self.last_step = None
        self._stepped = False
        self._epochs = None  # the data iterator does not exist yet; read at the first step

    def due(self, trainer: TrainerView, at_last_step: bool = True) -> bool:
        """Whether to act after the step that just finished (call it in ``on_after_step``).

        Args:
            trainer: The trainer.
            at_last_step: Whether the last step of the run counts (the rule); ``False``: only
                multiples of ``n``.
        """
        step = trainer.step
        self._stepped = True
        if self.unit == "steps":
            hit = step % self.n == 0
        else:
            epochs = trainer.run_length.epochs_completed
            before = trainer.run_length.epochs_at_start if self._epochs is None else self._epochs
            hit = epochs > before and epochs % self.n == 0
            self._epochs = epochs
        if hit or (at_last_step and trainer.run_length.reached(step)):
            self.last_step = step
            return True
        return False

    def due_at_end(self, trainer: TrainerView) -> bool:
        """Whether the run ended cleanly after a step not acted on (call it in ``on_after_train``)."""
        step = trainer.step
        if trainer.error is not None or not self._stepped or step == self.last_step:
            return False
        self.last_step = step
        return True
