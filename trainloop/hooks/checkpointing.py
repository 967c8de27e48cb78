"""Checkpoints: saving on a schedule and on exit signals, pruning, and resuming.

A checkpoint is a directory ``<path>/<step>/`` holding one ``torch.save`` file per top-level
key of ``trainer.state_dict()``: ``model.pt``, ``training_state.pt``, and one file per hook
that has state (named after its key). ``<path>/latest`` is a symlink to the newest one.
"""

from __future__ import annotations

import re
import signal
import time
from logging import Logger
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Annotated, Any, Literal, cast

import torch
import torch.distributed as dist
from pydantic import AfterValidator, Field, StrictInt, StrictStr, validate_call

from ..types import NonNegativeFloat, NonNegativeInt, PositiveInt
from ..utils import is_rank_zero
from ._atomic import (
    atomic_directory,
    clean_leftovers,
    remove_directory,
    replace_symlink,
)
from .base import BaseHook
from .registry import register_hook

if TYPE_CHECKING:
    from ..trainer import BaseTrainer

__all__ = [
    "CheckpointError",
    "CheckpointingHook",
    "checkpoint_steps",
    "latest_checkpoint",
    "read_checkpoint",
    "write_checkpoint",
]

LATEST = "latest"
_REQUIRED = ("model", "training_state")
_FILE_KEY = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be read (incomplete, corrupt, or refused as unsafe); names the file."""


def _as_signal(value: str | int) -> signal.Signals:
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


ExitSignal = Annotated[StrictStr | StrictInt, AfterValidator(_as_signal)]
"""A signal name (``"SIGTERM"``, ``"TERM"``) or number, validated into a ``signal.Signals``."""
ExitCode = Annotated[int, Field(ge=0, le=255, strict=True)]


@register_hook("checkpointing")
class CheckpointingHook(BaseHook):
    """Save checkpoints on a schedule and on exit signals; prune old ones; resume from one.

    Saves happen in the ``checkpointing`` state, at the end of every ``interval``-th step, of
    every step kept by ``keep_interval`` or ``keep_steps``, of the last step of a run that ends
    cleanly, and of the step during which an exit signal arrived. Each save is atomic (see
    :func:`write_checkpoint`); leftovers of a crashed save are cleaned at the next save or load.
    Under ``torch.distributed`` every rank builds the state dict and rank 0 writes it.

    Args:
        interval: Save every ``interval`` steps.
        keep_previous: Besides the newest checkpoint, keep this many earlier ones (by step).
        keep_interval: Also save, and never prune, every ``keep_interval``-th step (0: none).
        keep_steps: Also save, and never prune, these steps.
        path: Directory of the checkpoints; a relative path is resolved under the trainer's
            ``workspace``.
        load: What to resume from in ``restoring``: ``"latest"`` (the newest checkpoint under
            ``path``, if any), a checkpoint directory (relative to the working directory;
            must exist), or ``None`` (start fresh).
        exit_signals: Signals (names or numbers) that end the run cleanly: the current step
            finishes (under a process group, the next one: the step all ranks agree on), is
            saved, and ``train()`` raises ``SystemExit(exit_code)``. The handlers are installed
            for the run only.
        exit_code: The exit code after such a signal: ``"128+signal"`` (a shell's convention,
            143 for SIGTERM) or a number.
        exit_wait: Seconds to wait before that last save (e.g. for a cluster scheduler that
            signals every task of a job a little apart).

    Raises:
        pydantic.ValidationError: A parameter is invalid; the error names it.
    """

    @validate_call
    def __init__(
        self,
        interval: PositiveInt,
        keep_previous: NonNegativeInt = 0,
        keep_interval: NonNegativeInt = 0,
        keep_steps: list[PositiveInt] | None = None,
        path: Path = Path("checkpoints"),
        load: Literal["latest"] | Path | None = "latest",
        exit_signals: list[ExitSignal] | None = None,
        exit_code: Literal["128+signal"] | ExitCode = "128+signal",
        exit_wait: NonNegativeFloat = 0.0,
    ) -> None:
        self.interval = interval
        self.keep_previous = keep_previous
        self.keep_interval = keep_interval
        self.keep_steps = frozenset(keep_steps or ())
        self.path = Path(path).expanduser()
        self.load = load
        # Validation turned them into signal.Signals; dict.fromkeys drops repeats, keeps order.
        self.exit_signals = tuple(dict.fromkeys(cast("list[signal.Signals]", exit_signals or [])))
        self.exit_code = exit_code
        self.exit_wait = exit_wait
        self._caught: signal.Signals | None = None
        self._exit_asked = False
        self._previous_handlers: dict[signal.Signals, Any] = {}

    # -- restoring -----------------------------------------------------------------------------

    def on_enter_restoring(self, trainer: BaseTrainer) -> None:
        """Load the checkpoint ``load`` names, if any, into the trainer."""
        root = self.directory(trainer)  # fails early on a relative path without workspace
        if self.load is None:
            return
        if isinstance(self.load, Path):
            directory = self.load.expanduser()
            if not directory.is_dir():
                raise FileNotFoundError(
                    f"CheckpointingHook load={str(self.load)!r}: no checkpoint directory at {directory}"
                )
        else:  # "latest"
            if is_rank_zero():
                clean_leftovers(root, trainer.logger)
            _barrier()
            found = latest_checkpoint(root)
            if found is None:
                trainer.logger.info("No checkpoint in %s; starting from scratch", root)
                return
            directory = found
        trainer.logger.info("Loading checkpoint %s", directory)
        trainer.load_state_dict(read_checkpoint(directory))

    def on_before_train(self, trainer: BaseTrainer) -> None:
        """Ask for a save at the end of the run, and install the exit-signal handlers."""
        trainer.request_checkpoint(at_exit=True)
        self._caught, self._exit_asked = None, False
        try:
            for signum in self.exit_signals:
                # A bound method gets the signal number from the OS: no loop variable to close over.
                self._previous_handlers[signum] = signal.signal(signum, self._record_signal)
        except ValueError as error:  # not the main thread
            raise RuntimeError(f"CheckpointingHook exit_signals cannot be installed: {error}") from error

    def _record_signal(self, signum: int, frame: FrameType | None) -> None:
        # Only record: the step in progress finishes, and on_after_step acts on it.
        if self._caught is None:
            self._caught = signal.Signals(signum)

    # -- stepping ------------------------------------------------------------------------------

    def on_after_step(self, trainer: BaseTrainer) -> None:
        """Request a save when one is due; after an exit signal, request the exit."""
        step = trainer.step
        if self._caught is not None and not self._exit_asked:
            # No request_checkpoint() here: it would hold on this rank only, and a save needs
            # every rank. The standing at-exit request saves the step all ranks agree to stop at.
            self._exit_asked = True
            code = 128 + self._caught if self.exit_code == "128+signal" else self.exit_code
            trainer.logger.warning(
                "Caught %s during step %d: the run saves and exits with code %d",
                self._caught.name, step, code,
            )
            trainer.request_exit(code)
        if step % self.interval == 0 or self._is_kept(step):
            trainer.request_checkpoint()

    def _is_kept(self, step: int) -> bool:
        return (self.keep_interval > 0 and step % self.keep_interval == 0) or step in self.keep_steps

    # -- checkpointing -------------------------------------------------------------------------

    def on_enter_checkpointing(self, trainer: BaseTrainer) -> None:
        """Write the trainer's state (rank 0), point ``latest`` at it, prune old checkpoints."""
        if self._caught is not None and self.exit_wait > 0:
            trainer.logger.info("Waiting %.1f s (exit_wait) before the exit checkpoint", self.exit_wait)
            time.sleep(self.exit_wait)
        state_dict = trainer.state_dict()  # on every rank: a sharded model gathers collectively
        if is_rank_zero():
            root = self.directory(trainer)
            clean_leftovers(root, trainer.logger)
            written = write_checkpoint(root, trainer.step, state_dict)
            trainer.logger.info("Saved checkpoint %s", written)
            self._prune(root, trainer.step, trainer.logger)
        _barrier()  # no rank runs ahead of (or loads) a checkpoint rank 0 has not finished

    def _prune(self, root: Path, newest: int, logger: Logger) -> None:
        earlier = [step for step in checkpoint_steps(root) if step != newest]
        recent = set(earlier[-self.keep_previous :]) if self.keep_previous else set()
        for step in earlier:
            if step in recent or self._is_kept(step):
                continue
            try:
                remove_directory(root / str(step))
            except OSError as error:
                logger.warning("Could not remove old checkpoint %s: %s", root / str(step), error)

    # -- exiting -------------------------------------------------------------------------------

    def on_after_train(self, trainer: BaseTrainer) -> None:
        """Give the exit signals back to the handlers they had before the run."""
        while self._previous_handlers:
            signum, handler = self._previous_handlers.popitem()
            # None: the previous handler was not installed from Python; the default is closest.
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)

    # -- helpers -------------------------------------------------------------------------------

    def directory(self, trainer: BaseTrainer) -> Path:
        """Where this hook's checkpoints live for ``trainer``.

        Raises:
            ValueError: ``path`` is relative and the trainer has no workspace.
        """
        if self.path.is_absolute():
            return self.path
        if trainer.workspace is None:
            raise ValueError(
                f"CheckpointingHook path={str(self.path)!r} is relative but the trainer has no "
                "workspace; set the trainer's workspace or give an absolute path"
            )
        return trainer.workspace / self.path


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def checkpoint_steps(root: Path) -> list[int]:
    """The steps of the (complete) checkpoints under ``root``, ascending.

    Only complete checkpoints carry a step number as their name: one being written is hidden.
    """
    if not root.is_dir():
        return []
    return sorted(int(p.name) for p in root.iterdir() if p.name.isdigit() and p.is_dir())


def latest_checkpoint(root: Path) -> Path | None:
    """The checkpoint ``root/latest`` points to, else the highest step under ``root``, else ``None``."""
    link = root / LATEST
    if link.is_dir():
        return link.resolve()
    steps = checkpoint_steps(root)
    return root / str(steps[-1]) if steps else None


def write_checkpoint(root: Path, step: int, state_dict: dict[str, Any]) -> Path:
    """Write ``state_dict`` atomically as ``root/<step>/<key>.pt`` and point ``root/latest`` at it.

    The files are written into a hidden directory, fsynced, and renamed into place; then
    ``latest`` is replaced. A crash at any moment leaves the previous checkpoint or the new
    complete one, never a half-written directory under a step name. An existing
    ``root/<step>`` is replaced the same way.

    Args:
        root: The checkpoints directory (created if needed).
        step: The step, which names the directory.
        state_dict: A trainer's ``state_dict()``; each top-level key becomes one file.

    Returns:
        The checkpoint directory.

    Raises:
        ValueError: A top-level key cannot name a file.
    """
    for key in state_dict:
        if not _FILE_KEY.fullmatch(key):
            raise ValueError(
                f"state_dict key {key!r} cannot name a checkpoint file; use letters, digits, '_', '-', '.'"
            )
    target = root / str(step)
    with atomic_directory(target) as tmp:
        for key, value in state_dict.items():
            torch.save(value, tmp / f"{key}.pt")
    replace_symlink(root / LATEST, target.name)
    return target


def read_checkpoint(directory: Path) -> dict[str, Any]:
    """Read a checkpoint directory back into a trainer state dict (tensors on the CPU).

    Files are read with ``torch.load(weights_only=True)``: tensors, numbers, strings and plain
    containers only, so a checkpoint cannot run code when it is loaded.

    Raises:
        CheckpointError: A required file is missing, or a file is corrupt or holds other objects
            (the message names the file).
    """
    files = {path.stem: path for path in sorted(directory.glob("*.pt"))}
    missing = [f"{key}.pt" for key in _REQUIRED if key not in files]
    if missing:
        raise CheckpointError(f"{directory} is not a complete checkpoint: missing {', '.join(missing)}")
    return {key: _load_file(path) for key, path in files.items()}


def _load_file(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        refused = _refusal(error)
        if refused is not None:
            raise CheckpointError(
                f"{path}: refused to load: it holds objects other than tensors and plain "
                f"containers, and unpickling them could run code ({refused})"
            ) from error
        raise CheckpointError(f"{path}: cannot load: {error}") from error


def _refusal(error: BaseException) -> str | None:
    """What ``weights_only`` refused, if that is why loading failed (else ``None``)."""
    # torch's message is long and advises weights_only=False; keep only what it refused.
    text = str(error)
    if "Weights only load failed" not in text:
        return None
    marker = "WeightsUnpickler error:"
    for line in text.splitlines():
        if marker in line:
            return line.split(marker, 1)[1].split(" Please use", 1)[0].strip()
    return "weights_only=True"
