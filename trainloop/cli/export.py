"""``trainloop export CHECKPOINT --output model.safetensors``: a checkpoint's weights, consolidated
into one ``.safetensors`` file (see :mod:`trainloop.checkpoint.export`).

Exit codes: 0 written; 1 the checkpoint cannot be used (missing, corrupt, no such weights) or
the file cannot be written; 2 bad arguments.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

__all__ = ["add_parser", "run"]

FAILURE = 1


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``export`` command to ``subparsers`` (an ``argparse`` subparsers action)."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "export", help="write a checkpoint's weights to one .safetensors file",
        description="Write the model's (or its EMA hook's) weights of a checkpoint, full or sharded, to one "
        ".safetensors file: clean keys, tied weights included, metadata with the step, the settings' hash "
        "and the trainloop version. Give a checkpoint directory, a checkpoints root or a workspace (its latest).",
    )
    parser.add_argument("checkpoint", metavar="CHECKPOINT")
    parser.add_argument("--output", "-o", required=True, metavar="PATH", help="the .safetensors file to write")
    parser.add_argument("--weights", default="model", metavar="WHICH",
                        help='"model" (default), "ema", or the name of the EMA hook whose weights to export')
    parser.set_defaults(handler=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """``trainloop export``: write the file, or say in one line why not."""
    from trainloop.checkpoint.errors import CheckpointError
    from trainloop.checkpoint.export import export_checkpoint

    try:
        metadata = export_checkpoint(args.checkpoint, args.output, args.weights)
    except CheckpointError as error:
        for line in str(error).splitlines():
            print(f"trainloop export: error: {line}", file=sys.stderr)
        return FAILURE
    except OSError as error:
        print(f"trainloop export: error: {error.filename or args.output}: cannot write: {error.strerror}", file=sys.stderr)
        return FAILURE
    step = f" of step {metadata['step']}" if "step" in metadata else ""
    print(f"trainloop export: wrote the {args.weights} weights{step} to {args.output}", file=sys.stderr)
    return 0
