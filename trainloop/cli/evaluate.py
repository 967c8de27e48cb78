"""``trainloop evaluate``: every validation of a run once, on a checkpoint's weights; the metrics as JSON.

The settings are checked as ``run`` checks them; then ``trainer.evaluate()`` runs (``building ->
restoring -> validating -> exiting``) and rank 0 prints the metrics as one JSON object on stdout
(``{"val/loss": 0.31, "val/accuracy": 0.96}``); logs go to stderr. Nothing is written into the
checkpoint directory.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from trainloop.checkpoint.errors import CheckpointError
from trainloop.cli.errors import FAILURE, PROG, CliError
from trainloop.cli.run import configure_logging
from trainloop.cli.settings import checked_settings
from trainloop.core.preflight import checked
from trainloop.core.result import RefusedRunError
from trainloop.core.run_kinds import EvaluateError
from trainloop.distributed.ranks import is_rank_zero
from trainloop.utils import strict_json

__all__ = ["command"]


def command(args: argparse.Namespace) -> int:
    """Evaluate with the settings ``args`` name and print the metrics; a problem is a ``CliError``."""
    settings, trainer_class = checked_settings(args, trainer_required=True)
    assert trainer_class is not None  # required above
    checkpoint: str | Path | None = None if args.checkpoint == "none" else args.checkpoint
    configure_logging(args.log_level)
    try:
        with checked(settings, trainer_class):  # the preflight above ran: evaluate() does not repeat it
            metrics = trainer_class(settings).evaluate(checkpoint, weights=args.weights)
    except EvaluateError as error:
        raise CliError(str(error)) from None
    except RefusedRunError as error:  # what it builds cannot run (build_optimizer()'s names, a declared module)
        raise CliError(str(error), error.exit_code) from None
    except CheckpointError as error:
        raise CliError(str(error), FAILURE) from None
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT
    if is_rank_zero():
        sys.stdout.write(strict_json(metrics) + "\n")
    return 0
