"""Resuming from a checkpoint: choosing it, loading it, saying what the run starts from.

The one to load is verified on every rank; ``CheckpointingHook`` calls these in ``restoring``.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from logging import Logger
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainloop.checkpoint.atomic import clean_leftovers
from trainloop.checkpoint.files import checkpoint_candidates
from trainloop.distributed.ranks import is_rank_zero

if TYPE_CHECKING:
    from trainloop.checkpoint.loading import VerifiedFiles
    from trainloop.run_state import TrainerView

__all__ = ["choose_checkpoint", "load_checkpoint", "say", "sharded_state_dict"]


def load_checkpoint(trainer: TrainerView, root: Path, load: Path | str) -> Path | None:
    """Load the checkpoint ``load`` names (a directory, or ``"latest"`` under ``root``) into ``trainer``.

    Returns:
        The checkpoint directory loaded, or ``None`` when ``"latest"`` found none.
    """
    chosen = choose_checkpoint(trainer, root, load)
    if chosen is None:
        return None
    directory, state = chosen
    trainer.logger.info("Loading checkpoint %s", directory)
    if isinstance(state, dict):  # a full checkpoint, read and verified by choose_checkpoint
        trainer.load_state_dict(state)
        return directory
    from trainloop.checkpoint.sharded import load_sharded

    try:  # DCP reads through the files: this rank's share verified already, the rest as read
        with sharded_state_dict(trainer):
            trainer.load_state_dict(load_sharded(directory, trainer.state_dict(), state))
    finally:
        state.close()
    return directory


def choose_checkpoint(
    trainer: TrainerView, root: Path, load: Path | str
) -> tuple[Path, dict[str, Any] | VerifiedFiles] | None:
    """The checkpoint to load: its state dict if full, its files (this rank's share verified) if sharded.

    Rank 0 lists the candidates, every rank verifies their files as it reads them (a sharded one: its share; see
    :mod:`trainloop.checkpoint.verify`); the same answer on every rank.
    """
    from trainloop.checkpoint.saver import broadcast_from_rank_zero
    from trainloop.checkpoint.verify import open_checkpoint

    candidates: list[Path] | None = None
    error: BaseException | None = None
    if is_rank_zero():
        try:
            if isinstance(load, Path):
                found = load.expanduser()
                if not found.is_dir():
                    raise FileNotFoundError(
                        f"CheckpointingHook load={str(load)!r}: no checkpoint directory at {found}"
                    )
                candidates = [found]
            else:  # "latest"
                clean_leftovers(root, trainer.logger)
                candidates = checkpoint_candidates(root, trainer.logger)
        except OSError as failure:
            error = failure
    error = broadcast_from_rank_zero(error)
    if error is not None:
        raise error
    return open_checkpoint(candidates, explicit=isinstance(load, Path), log=trainer.logger)


def say(logger: Logger, message: str, *args: Any) -> None:
    """Tell the user (rank 0) what the run starts from.

    Logged at INFO when logging is configured, else one line on stderr (Python shows no INFO record by default).
    """
    if not is_rank_zero():
        return
    if logger.hasHandlers():
        logger.info(message, *args)
    else:
        print(f"trainloop: {message % args}", file=sys.stderr, flush=True)


@contextmanager
def sharded_state_dict(trainer: TrainerView) -> Iterator[None]:
    """Make ``trainer.state_dict()`` and ``load_state_dict()`` keep each rank's shards.

    The trainer's own options may ask for full tensors (for full checkpoints); DCP needs the
    sharded form, so the other options are kept and these two switched off for the moment.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    saved = trainer.state_dict_options
    trainer.state_dict_options = dataclasses.replace(
        saved or StateDictOptions(), full_state_dict=False, cpu_offload=False, broadcast_from_rank0=False
    )
    try:
        yield
    finally:
        trainer.state_dict_options = saved
