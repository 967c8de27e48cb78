"""``trainloop export CHECKPOINT --output model.safetensors``.

A checkpoint's weights, consolidated into one ``.safetensors`` file (see :mod:`trainloop.checkpoint.export`).

Exit codes: 0 written; 1 the checkpoint cannot be used (missing, corrupt, no such weights) or
the file cannot be written; 2 bad arguments.
"""

from __future__ import annotations

import argparse
import sys

from trainloop.checkpoint.errors import CheckpointError
from trainloop.checkpoint.export import export_checkpoint
from trainloop.checkpoint.storage import StorageError, is_dir, location
from trainloop.cli.errors import FAILURE, PROG, CliError

__all__ = ["command"]


def command(args: argparse.Namespace) -> int:
    """Write the file, or say in one line why not (a bad ``--output`` before anything is read)."""
    try:  # a URL (either argument) names its filesystem, configured by fsspec's configuration
        output, checkpoint = location(args.output), location(args.checkpoint)
    except StorageError as error:
        raise CliError(str(error)) from None
    if is_dir(output):  # an empty --output is refused by the parser (trainloop.cli.path_text)
        raise CliError(f"--output {args.output!r} is a directory: give the .safetensors file to write")
    try:
        metadata = export_checkpoint(checkpoint, output, args.weights)
    except CheckpointError as error:
        raise CliError(str(error), FAILURE) from None
    except OSError as error:
        raise CliError(f"{error.filename or args.output}: cannot write: {error.strerror}", FAILURE) from None
    step = f" of step {metadata['step']}" if "step" in metadata else ""
    print(f"{PROG} export: wrote the {args.weights} weights{step} to {args.output}", file=sys.stderr)
    return 0
