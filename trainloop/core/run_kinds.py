"""Runs that train nothing (``evaluate``; predict likewise): where their model's weights come from.

An evaluate run is ``building -> restoring -> validating -> exiting``: the trainer builds its
components and hooks as for training, ``restoring`` loads the model's weights alone (no
optimizer state, no hook state, no data position) from the source a ``WeightsSource`` names,
``validating`` runs every validation hook once, and the run exits. It writes nothing into the
checkpoint directory, nor ``settings.json``, ``metrics.jsonl`` or ``trace.jsonl``: only its line
in ``runs.jsonl`` (``"kind": "evaluate"``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from trainloop.checkpoint.errors import CheckpointError
from trainloop.checkpoint.storage import is_dir, is_file
from trainloop.location import Location, StorageError, location
from trainloop.machine.table import State

if TYPE_CHECKING:
    from trainloop.checkpoint.weights import Weights
    from trainloop.core.result import RunKind
    from trainloop.core.run_state import TrainerView
    from trainloop.hook_machinery.base import BaseHook

__all__ = ["EvaluateError", "RunOfKind", "WeightsSource", "Work", "check_validations", "restore_weights"]


#: What ``checkpoint=`` (``--checkpoint``) takes besides a directory.
LATEST: Literal["latest"] = "latest"


class EvaluateError(ValueError):
    """An evaluate run cannot start (no validation to run, a checkpoint that is not there)."""


@dataclass(frozen=True)
class WeightsSource:
    """Where an evaluate (or predict) run takes the model's weights from.

    Attributes:
        checkpoint: ``"latest"``: the run's latest complete checkpoint (in its
            ``CheckpointingHook``'s directory, else ``<workspace>/checkpoints``), an error if
            there is none; a checkpoint directory (full or sharded), a checkpoints root or a
            workspace (its latest), local or a URL; or ``None``: the model as ``build_model`` made it (with
            ``settings.init_from`` applied).
        weights: ``"model"``, ``"ema"`` (the one EMA hook's averaged weights in the
            checkpoint) or the name of the EMA hook whose weights to take.
    """

    checkpoint: Literal["latest"] | Location | None = LATEST
    weights: str = "model"

    @classmethod
    def of(cls, checkpoint: str | Path | None, weights: str = "model") -> WeightsSource:
        """From what a user gives: ``"latest"``, a path, or ``None``; the path is checked to exist.

        Raises:
            EvaluateError: ``weights`` is given without a checkpoint.
            CheckpointError: The path does not exist.
        """
        if checkpoint is None:
            if weights != "model":
                raise EvaluateError(f"weights={weights!r} needs a checkpoint to read them from")
            return cls(None, weights)
        if checkpoint == LATEST:
            return cls(LATEST, weights)
        try:
            path = location(checkpoint)  # a URL's filesystem configured by fsspec's configuration
        except StorageError as error:
            raise CheckpointError(f"checkpoint {error}") from None
        if is_file(path):
            raise CheckpointError(
                f"checkpoint {checkpoint}: a file, not a checkpoint directory (a directory a CheckpointingHook saved, "
                "such as <workspace>/checkpoints/<step>, holding manifest.json; or latest)"
            )
        if not is_dir(path):
            raise CheckpointError(f"checkpoint {checkpoint}: no such directory")
        return cls(path, weights)


def check_validations(hooks: Sequence[BaseHook], where: str) -> None:
    """Raise ``EvaluateError`` unless a hook validates (a schedule of ``state="validating"``).

    Args:
        hooks: The run's hooks.
        where: Where they come from, for the message.
    """
    if not any(h.schedule is not None and h.schedule.state == "validating" for h in hooks):
        raise EvaluateError(
            f"nothing to evaluate: {where} has no ValidationHook; declare one in settings.hooks "
            '({"type": "validation", "evaluate": "<method name>", "interval": N}) or return one from build_hooks()'
        )


def restore_weights(trainer: TrainerView, hooks: Sequence[BaseHook], source: WeightsSource) -> Weights | None:
    """Load the weights ``source`` names into ``trainer.model``, on every rank; ``None``: none were named.

    Args:
        trainer: The trainer, its model built.
        hooks: Every hook the trainer built (each says where it keeps checkpoints: ``checkpoint_directory``).
        source: Where the weights come from.

    Raises:
        CheckpointError: ``"latest"`` and the run has no complete checkpoint, or the checkpoint
            cannot be read or does not fit the model; the message names the directory.
    """
    from trainloop.checkpoint.weights import load_weights, read_weights

    if source.checkpoint is None:
        return None
    if source.checkpoint == LATEST:  # verified (a corrupt one skipped, said once) while it was found
        found = read_weights(_latest_checkpoint(trainer, hooks), source.weights, verified=True)
    else:
        found = read_weights(source.checkpoint, source.weights, logger=trainer.logger)
    loaded = load_weights(trainer.model, found.state_dict, logger=trainer.logger, source=str(found.source))
    at = f" (step {found.step})" if found.step is not None else ""
    trainer.logger.info("Loaded %d %s weights from %s%s", len(loaded), source.weights, found.source, at)
    return found


def _latest_checkpoint(trainer: TrainerView, hooks: Sequence[BaseHook]) -> Location:
    """The run's latest complete checkpoint (verified once here, not looked for again by the reader).

    Raises:
        CheckpointError: There is none.
    """
    from trainloop.checkpoint.manager import latest_checkpoint

    roots: list[Any] = [root for h in hooks if (root := h.checkpoint_directory(trainer)) is not None]
    if not roots and trainer.workspace is not None:
        roots = [trainer.workspace / "checkpoints"]
    for root in roots:
        found = latest_checkpoint(root, logger=trainer.logger)
        if found is not None:
            return found
    where = ", ".join(str(r) for r in roots) or "no workspace and no CheckpointingHook"
    raise CheckpointError(
        f"no complete checkpoint to load ({where}): train first, give a checkpoint directory, "
        "or use the model as built (checkpoint=None, --checkpoint none)"
    )


Work = dict[State, Callable[[], None]]
"""Each state's work in a run."""


class RunOfKind:
    """One run of a kind: the hooks that take part, each state's work, when it is done, and whether it is recorded.

    Args:
        kind: ``"train"``, ``"evaluate"`` or ``"predict"``.
        source: Where a run that trains nothing takes the model's weights from.
        predict_work: A predict run's work per state (``trainer.predict()`` makes it).

    Attributes:
        built_hooks: Every hook the run built, also those a run that trains nothing leaves out
            (a hook that keeps checkpoints still says where they are).
        recorded: Whether the run is recorded however it ends: a training run always, a run that
            trains nothing once its weights are restored.
        trains, evaluates, predicts: The run's kind, as the loop's policies ask it.
        done: A run that trains nothing: its one pass is done.
    """

    def __init__(
        self, kind: RunKind = "train", source: WeightsSource | None = None, predict_work: Work | None = None
    ) -> None:
        self.kind = kind
        self.source = source if source is not None else WeightsSource()
        self.predict_work = predict_work
        self.built_hooks: tuple[BaseHook, ...] = ()
        self.trains, self.evaluates, self.predicts = kind == "train", kind == "evaluate", kind == "predict"
        self.recorded = self.trains
        self.done = False

    def pass_done(self) -> None:
        """A validation pass ended: a run that trains nothing is done."""
        self.done = not self.trains

    def work(self, training: Work, restore_weights: Callable[[], None]) -> Work:
        """Each state's work in a run of this kind.

        Args:
            training: Each state's work in a training run.
            restore_weights: The work of ``restoring`` in an evaluate run (the weights alone).
        """
        if self.trains:
            return training
        if self.predicts:
            work = dict(self.predict_work)  # type: ignore[arg-type]  # trainer.predict() made it
        else:
            work = {**training, State.RESTORING: restore_weights}
        restore = work[State.RESTORING]

        def restored() -> None:
            restore()
            self.recorded = True  # from here on it is a run, recorded even if it fails

        work[State.RESTORING] = restored
        return work

    def taking_part(self, hooks: Sequence[BaseHook], owner: str) -> list[BaseHook]:
        """The hooks that take part: all of them in training, else the validations alone.

        No other hook loads, saves or watches a run that trains nothing.

        Args:
            hooks: The hooks the run built, in order.
            owner: Where they come from (the trainer class), for the message.

        Raises:
            trainloop.core.run_kinds.EvaluateError: An evaluate run and no hook validates.
        """
        if self.trains:
            return list(hooks)
        self.built_hooks = tuple(hooks)
        validations = [h for h in hooks if h.schedule is not None and h.schedule.state == "validating"]
        if self.evaluates:
            check_validations(validations, owner)
        return validations
