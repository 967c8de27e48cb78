"""Checkpoints on disk or object storage: layout, formats (full and sharded), integrity manifest, atomic writes.

:class:`~trainloop.hooks.checkpointing.CheckpointingHook` saves and resumes a run with these;
they also serve tools that inspect or convert checkpoints. ``metadata.json`` and
``manifest.json`` are plain JSON, readable without torch. Where a path is taken, an fsspec URL
is too (see :mod:`trainloop.checkpoint.storage`).
"""

from trainloop.checkpoint.errors import CheckpointError, CheckpointSaveError
from trainloop.checkpoint.export import export_checkpoint, save_weights
from trainloop.checkpoint.files import (
    LATEST,
    checkpoint_format,
    checkpoint_steps,
    latest_checkpoint,
    read_checkpoint,
    write_checkpoint,
)
from trainloop.checkpoint.manifest import METADATA, read_metadata, verify_checkpoint
from trainloop.checkpoint.storage import MANIFEST
from trainloop.checkpoint.weights import load_weights, read_weights

__all__ = [
    "LATEST",
    "MANIFEST",
    "METADATA",
    "CheckpointError",
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
