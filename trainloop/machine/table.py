"""The training state machine as data: its states and its transition table.

The table ``TRANSITIONS`` is the single description of the loop. Rows that leave the same
state are tried top to bottom; the first whose condition holds fires, and runs the row's
action (if any) on the way (``trainloop.machine.runner`` runs it; ``trainloop.machine.diagram``
draws it).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

__all__ = ["FAIL", "NOTES", "State", "TRANSITIONS", "Transition"]


class State(str, Enum):
    """The states of a training run."""

    IDLE = "idle"
    """Constructed, ``train()`` not called yet."""
    BUILDING = "building"
    """Building data loader, model, optimizer, lr scheduler, grad scaler and hooks."""
    RESTORING = "restoring"
    """Loading a checkpoint (if a hook does), then ``on_before_train``."""
    ACCUMULATING = "accumulating"
    """One microstep: draw a batch, ``forward``, backward. Entered for every microstep of a
    step, the first included (also without accumulation); with several optimizers, for each
    update's, which replay the step's batches."""
    STEPPING = "stepping"
    """An optimizer update: unscale, ``Loss`` normalisation, clipping, the non-finite check,
    optimizer and scheduler step; after the step's last update, ``on_after_step``. A fused optimizer skips
    a non-finite update in its own kernel: no edge, the step counts, and the loop learns of it
    a step late (a ``skipped`` mark in the trace; see ``NOTES``)."""
    RETRYING = "retrying"
    """The update found non-finite gradients (fp16's refused updates included) on the host, and
    another try is allowed (retries left; under fp16, a loss scale not below
    ``min_loss_scale``): zero them, reset the step's records, count the retry. Only where the
    optimizer cannot skip on the device, and for a fused one's first update."""
    CHECKPOINTING = "checkpointing"
    """A save is due; hooks write it."""
    VALIDATING = "validating"
    """One or more validations are due (a ``ValidationHook``'s schedule after an applied update,
    ``at_start`` after ``restoring``, the last step of a run that ends cleanly; never after an
    exit signal unless the hook asks), or the run is an evaluate run: each due validation runs
    and logs its metrics here, so its time is its own."""
    PREDICTING = "predicting"
    """A predict run's work, once: ``predict_step`` over the predict data in eval mode, under
    ``torch.no_grad()`` and the trainer's autocast; the outputs gathered from every rank, each item
    once, in dataset order, and written to one file (see ``trainloop.predict``)."""
    EXITING = "exiting"
    """``on_after_train``, data iterator closed. Final."""

    def __str__(self) -> str:
        return self.value

    # str's own hash, in C: Enum's is a Python call (the loop looks states up in dicts every
    # microstep), and it agrees with ``==``, which compares the string value.
    __hash__ = str.__hash__


@dataclass(frozen=True)
class Transition:
    """One row of the transition table.

    Attributes:
        trigger: The event's name, as it appears in traces and diagrams.
        source: The state the edge leaves.
        dest: The state the edge enters.
        condition: Name of the policy that must hold for the edge to fire (a key of the
            ``conditions`` mapping given to ``StateMachine``); ``None`` always holds.
        action: Name of the bookkeeping the edge does when it fires (a key of the ``actions``
            mapping given to ``StateMachine``). It runs once the machine is in ``dest``, before
            ``dest``'s entry callbacks: they see what it did. ``None``: nothing.
    """

    trigger: str
    source: State
    dest: State
    condition: str | None = None
    action: str | None = None


_S = State

#: The loop, readable top to bottom. Per source state, rows are tried in this order. Every
#: decision about what follows an optimizer update leaves from ``stepping``.
TRANSITIONS: tuple[Transition, ...] = (
    Transition("start", _S.IDLE, _S.BUILDING),
    Transition("restore", _S.BUILDING, _S.RESTORING),
    Transition("finish", _S.RESTORING, _S.EXITING, "should_exit"),
    Transition("validate", _S.RESTORING, _S.VALIDATING, "validation_due"),
    Transition("predict", _S.RESTORING, _S.PREDICTING, "predicting_run"),
    Transition("begin_step", _S.RESTORING, _S.ACCUMULATING, action="begin_step"),
    Transition("accumulate", _S.ACCUMULATING, _S.ACCUMULATING, "microsteps_remain"),
    Transition("update", _S.ACCUMULATING, _S.STEPPING),
    Transition("retry", _S.STEPPING, _S.RETRYING, "grads_non_finite"),
    # Several optimizers: each updates in turn, on the step's batches.
    Transition("next_update", _S.STEPPING, _S.ACCUMULATING, "updates_remain", action="next_update"),
    Transition("validate", _S.STEPPING, _S.VALIDATING, "validation_due"),
    Transition("checkpoint", _S.STEPPING, _S.CHECKPOINTING, "checkpoint_due"),
    Transition("finish", _S.STEPPING, _S.EXITING, "should_exit"),
    Transition("begin_step", _S.STEPPING, _S.ACCUMULATING, action="begin_step"),
    Transition("redo_step", _S.RETRYING, _S.ACCUMULATING, action="redo_step"),
    Transition("finish", _S.CHECKPOINTING, _S.EXITING, "should_exit"),
    Transition("begin_step", _S.CHECKPOINTING, _S.ACCUMULATING, action="begin_step"),
    Transition("checkpoint", _S.VALIDATING, _S.CHECKPOINTING, "checkpoint_due"),
    Transition("finish", _S.VALIDATING, _S.EXITING, "should_exit"),
    Transition("begin_step", _S.VALIDATING, _S.ACCUMULATING, action="begin_step"),
    Transition("finish", _S.PREDICTING, _S.EXITING),
    # An error (or an interrupt) anywhere ends the run through ``exiting``.
    *(Transition("fail", s, _S.EXITING) for s in _S if s not in (_S.IDLE, _S.EXITING)),
)

FAIL = "fail"

#: What happens in a state without an edge of its own, written beside it in the docs' drawings.
NOTES: dict[State, tuple[str, ...]] = {
    _S.STEPPING: (
        "a fused optimizer skips a non-finite update",
        "in its kernel: no edge, the step counts;",
        "learned a step late (trace: a skipped mark)",
    ),
    _S.RETRYING: ("where the optimizer cannot skip on the device", "(and a fused one's first update)"),
}
