"""Checkpoints on disk or object storage: the manager that saves and loads them, formats, manifest, atomic writes.

:class:`~trainloop.hooks.checkpointing.CheckpointingHook` hands a run's saves and its resume to a
:class:`~trainloop.checkpoint.manager.CheckpointManager`; the functions here also serve tools
that inspect or convert checkpoints. ``metadata.json`` and
``manifest.json`` are plain JSON, readable without torch. Where a path is taken, an fsspec URL
is too (see :mod:`trainloop.location`).
"""

from trainloop.checkpoint.errors import CheckpointError, CheckpointMismatchError, CheckpointSaveError
from trainloop.checkpoint.export import export_checkpoint, save_weights
from trainloop.checkpoint.files import checkpoint_format, read_checkpoint
from trainloop.checkpoint.manager import checkpoint_steps, latest_checkpoint, write_checkpoint
from trainloop.checkpoint.manifest import METADATA, read_metadata, verify_checkpoint
from trainloop.checkpoint.storage import LATEST, MANIFEST
from trainloop.checkpoint.weights import load_weights, read_weights

__all__ = [
    "LATEST",
    "MANIFEST",
    "METADATA",
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointSaveError",
    "checkpoint_format",
    "checkpoint_steps",
    "export_checkpoint",
    "latest_checkpoint",
    "load_weights",
    "read_checkpoint",
    "read_metadata",
    "read_weights",
    "save_weights",
    "verify_checkpoint",
    "write_checkpoint",
]
