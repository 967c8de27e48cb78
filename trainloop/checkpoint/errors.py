"""What goes wrong with checkpoints, as exceptions that name the path at fault."""

from __future__ import annotations

__all__ = ["CheckpointError", "CheckpointMismatchError", "CheckpointSaveError"]


class CheckpointError(RuntimeError):
    """A checkpoint cannot be read (incomplete, corrupt, or refused as unsafe) or written.

    The message names the file or directory.
    """


class CheckpointMismatchError(CheckpointError):
    """A sound checkpoint this run cannot resume from as declared (another number of ranks, ZeRO stage, precision).

    Refused before the first step, one line per difference: the command line exits with ``exit_code`` (a usage
    error), and the run is not recorded in ``runs.jsonl``.
    """

    exit_code = 2


class CheckpointSaveError(CheckpointError):
    """A checkpoint could not be written (disk full, permission denied...).

    Nothing partial was left under its name. The message names the checkpoint and, when known, the file; the operating
    system's error is the ``__cause__`` on the process that met it.
    """
