"""``RunResult``: what ``train()`` returns, and ``<workspace>/runs.jsonl``: one line per run.

Each run that has a workspace appends its outcome (rank 0)::

    {"time": 1700000000.0, "kind": "train", "step": 400, "epoch": 7, "exit_code": 0, "error": null,
     "best_checkpoint": "runs/digits/checkpoints/400", "started": 1699999940.0, "device": "cpu",
     "torch": "2.5.1", "trainloop": "0.1.0"}

so a report shows how each run of a workspace ended (a signal's exit code, an error), which were
evaluate or predict runs (``"kind"``; a line without it is a training run's), how long each took,
and on what. A run refused before its first step (an error that carries its exit code, such as
``ChangedGlobalBatchError``) is not a run: it appends nothing.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from trainloop.location import Location, UrlPath
from trainloop.utils import append_line, strict_json

if TYPE_CHECKING:
    from trainloop.core.run_state import TrainerView

__all__ = [
    "RUNS_FILE", "RefusedHooksError", "RefusedRunError", "RunKind", "RunResult",
    "finish_run", "read_runs", "run_result",
]

RUNS_FILE = "runs.jsonl"


class RefusedRunError(ValueError):
    """What the run declares cannot run, found before its first step: one line per problem.

    The command line reports it without a traceback and exits with ``exit_code`` (a usage error). Nothing is
    written: no line in ``runs.jsonl``, no checkpoint, no metric, no ``settings.json``.
    """

    exit_code = 2


class RefusedHooksError(RefusedRunError, TypeError):
    """The hooks a run built cannot run, one line per problem (``trainloop.hook_machinery.dispatch.hook_problems``).

    Refused before the first step as every ``RefusedRunError``; a ``TypeError`` too, as the mistakes it reports are.
    """


RunKind = Literal["train", "evaluate", "predict"]
"""What a run does: ``train()``, ``evaluate()`` (building, restoring, validating, exiting) or
predict (building, restoring, predicting, exiting)."""


@dataclass(frozen=True)
class RunResult:
    """The outcome of a run, as ``train()`` returns it (also kept as ``trainer.result``).

    Attributes:
        step: The last step run (or resumed at, when nothing was left to run); for a run ended
            by an error, the step in progress then, whose update may not have been applied. An
            evaluate or predict run: the step of the checkpoint whose weights it used.
        epoch: Full passes over the data completed; an evaluate or predict run: the epoch of
            the checkpoint whose weights it used (0 for the model as built).
        exit_code: ``0`` for a clean end; the code an exit signal asked for (``train()`` then
            raises ``SystemExit`` with it); for a run ended by an error, what the process would
            exit with: ``130`` for ``KeyboardInterrupt``, ``2`` for a refusal (``RefusedRunError``), else
            ``1`` (read the result from ``trainer.result``: ``train()`` re-raised the error).
        metrics: The last value of every key logged through ``trainer.log`` in this run,
            flattened (``"val/loss"``), as Python floats.
        best_checkpoint: The best checkpoint by a ``CheckpointingHook``'s ``monitor`` (with
            ``keep_best``), else ``None``.
        history: Every ``trainer.log`` call of this run as a flat record with ``step`` and
            ``time`` (the workspace's ``metrics.jsonl`` holds the resumed runs' too).
        error: ``"TypeName: message"`` of the error that ended the run, else ``None``.
        kind: ``"train"``, ``"evaluate"`` or ``"predict"``: which of the trainer's runs it was.
    """

    step: int
    epoch: int
    exit_code: int
    metrics: dict[str, float]
    best_checkpoint: Location | None = None
    history: list[dict[str, Any]] = field(default_factory=list, repr=False)
    error: str | None = None
    kind: RunKind = "train"


def run_result(trainer: TrainerView, kind: RunKind = "train") -> RunResult:
    """The result of ``trainer``'s run, read once it has exited."""
    best = None
    for hook in trainer.hooks:
        found = getattr(hook, "best_checkpoint", None)
        if isinstance(found, (Path, UrlPath)):  # a local directory, or one on object storage
            best = found
            break
    error = trainer.error
    if error is None or isinstance(error, SystemExit):
        exit_code = trainer.exit_code or 0
    else:
        # An error refused before the first step carries the code the command line exits with.
        exit_code = 130 if isinstance(error, KeyboardInterrupt) else getattr(error, "exit_code", 1)
    return RunResult(
        step=trainer.step,
        epoch=trainer.run_length.epochs_completed if kind == "train" else trainer.epoch,
        exit_code=exit_code,
        metrics=dict(trainer.metrics.last),
        best_checkpoint=best,
        history=list(trainer.metrics.history),
        error=None if error is None else f"{type(error).__name__}: {error}"[:500],
        kind=kind,
    )


def _refused(trainer: TrainerView) -> bool:
    """Whether the run was refused before its first step: its error carries the exit code of a refusal.

    Such a run is not recorded, so that a refusal leaves the workspace as it found it.
    """
    error = trainer.error
    return error is not None and not isinstance(error, SystemExit) and hasattr(error, "exit_code")


def _reran_complete(trainer: TrainerView, result: RunResult) -> bool:
    """Whether the run resumed a run that had completed and ended cleanly, having trained nothing.

    It is not a run of its own (the workspace's record of that run stands).
    """
    resumed_complete = any(getattr(hook, "resumed_complete", False) for hook in trainer.hooks)
    return resumed_complete and result.exit_code == 0 and result.error is None


def finish_run(
    trainer: TrainerView, kind: RunKind = "train", write: bool = True, started: float | None = None
) -> RunResult:
    """The result of ``trainer``'s run of ``kind``; with ``write``, appended to ``<workspace>/runs.jsonl`` (rank 0).

    Args:
        trainer: The trainer whose run ended.
        kind: What the run did: train, evaluate or predict.
        write: Whether to append the run's line (a run refused while building is not recorded,
            nor one refused before its first step).
        started: When the run started (``time.time()``), recorded beside its end.
    """
    from trainloop.distributed.ranks import is_rank_zero

    result = run_result(trainer, kind)
    workspace = trainer.settings.workspace
    written = write and workspace is not None and is_rank_zero() and workspace.is_dir()
    if written and not _refused(trainer) and not _reran_complete(trainer, result):
        assert workspace is not None
        record = {
            "time": time.time(),
            "kind": kind,
            "step": result.step,
            "epoch": result.epoch,
            "exit_code": result.exit_code,
            "error": result.error,
            "best_checkpoint": None if result.best_checkpoint is None else str(result.best_checkpoint),
            **_environment(trainer, started),
        }
        try:
            append_line(workspace / RUNS_FILE, strict_json(record) + "\n")
        except OSError as error:
            # Never in place of the error that ended the run, which is what the user needs.
            trainer.logger.error("Could not record the run in %s: %s", workspace / RUNS_FILE, error)
    return result


def _environment(trainer: TrainerView, started: float | None) -> dict[str, Any]:
    """When the run started, and on what: the device and the versions of torch and trainloop."""
    import torch

    from trainloop.version import __version__

    return {"started": started, "device": str(trainer.device), "torch": torch.__version__, "trainloop": __version__}


def read_runs(workspace: Path) -> list[dict[str, Any]]:
    """The runs recorded in ``workspace/runs.jsonl`` (none if it is missing); bad lines are skipped."""
    try:
        lines = (workspace / RUNS_FILE).read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    runs = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            runs.append(row)
    return runs
