"""Helpers for the checks a hook class makes of its declared settings (``BaseHook.check_settings``).

The preflight (``trainloop.core.preflight``) asks each declared hook class; these are the
pieces several built-in hooks share.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from trainloop.distributed.ranks import in_process_group, world_size

__all__ = ["HookProblem", "listed", "needs_workspace", "one_process", "workspace_only"]

#: One problem of a declared hook: the parameter at fault (``None``: the hook as a whole), and what is wrong.
HookProblem = tuple[str | None, str]


def needs_workspace(settings: Any, path: Path | None, name: str, what: str) -> list[HookProblem]:
    """A problem if files go to ``path`` and no workspace is set while ``path`` is relative.

    ``path`` ``None`` means a default under the workspace.

    Args:
        settings: The run's ``TrainerSettings``.
        path: The declared path, or ``None``.
        name: The parameter holding it.
        what: Where the files go, in words (``"checkpoints go to 'c', a relative path"``).
    """
    if settings.workspace is None and (path is None or not Path(path).expanduser().is_absolute()):
        return [(name, f"{what}, but no workspace is set: set workspace or give an absolute path")]
    return []


def workspace_only(declared: Any, settings: Any, what: str) -> list[HookProblem]:
    """A problem if the hook writes ``what`` into the workspace and none is set."""
    return [(None, f"{declared.type} writes {what}, but no workspace is set")] if settings.workspace is None else []


def one_process() -> bool:
    """Whether this process runs alone: only then may a check read the filesystem.

    Under a launcher each rank runs the preflight by itself; a file check could pass on one rank
    and fail on another (no shared filesystem), leaving the others waiting in a collective. The
    checkpointing hook's own check, made on rank 0 and shared with every rank, covers that case.
    """
    if in_process_group():
        return world_size() == 1
    return os.environ.get("WORLD_SIZE", "1") == "1"


def listed(indices: Iterable[int]) -> str:
    """``hooks[0] and hooks[2]``: declared hooks named as a settings file writes them."""
    return " and ".join(f"hooks[{i}]" for i in indices)
