"""Which checkpoints stay: pruning the earlier ones after a save, off the training thread."""

from __future__ import annotations

from collections.abc import Callable
from logging import Logger
from pathlib import Path

from trainloop.checkpoint.atomic import remove_directory
from trainloop.checkpoint.files import checkpoint_steps

__all__ = ["prune"]


def prune(root: Path, newest: int, keep_previous: int, kept: Callable[[int], bool], logger: Logger) -> None:
    """Remove the checkpoints under ``root`` but ``newest``, the ``keep_previous`` before it and the ``kept``.

    ``kept(step)`` keeps the best and the kept intervals. Each removed one leaves its step name
    at once and is deleted on a helper thread; a failure is logged.
    """
    earlier = [step for step in checkpoint_steps(root) if step != newest]
    recent = set(earlier[-keep_previous:]) if keep_previous else set()
    for step in earlier:
        if step in recent or kept(step):
            continue
        path = root / str(step)

        def report(error: OSError, path: Path = path) -> None:
            logger.warning("Could not remove old checkpoint %s: %s", path, error)

        try:
            remove_directory(path, background=report)  # gone from its name now, deleted off the training thread
        except OSError as error:
            report(error)
