"""What goes wrong with checkpoints, as exceptions that name the path at fault."""

from __future__ import annotations

__all__ = ["CheckpointError", "CheckpointSaveError"]


class CheckpointError(RuntimeError):
    """A checkpoint cannot be read (incomplete, corrupt, or refused as unsafe) or written.

    The message names the file or directory.
    """


class CheckpointSaveError(CheckpointError):
    """A checkpoint could not be written (disk full, permission denied...).

    Nothing partial was left under its name. The message names the checkpoint and, when known, the file; the operating
    system's error is the ``__cause__`` on the process that met it.
    """
