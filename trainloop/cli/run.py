"""``trainloop run``: validate and preflight the settings with the trainer's class, then train.

A checkpoint or weights file that cannot be used once the run has started (``init_from``'s keys
that do not fit the model, a checkpoint that cannot be saved) ends the command with exit code 1
and one line naming the file; the run's line in ``runs.jsonl`` records the error.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys

from trainloop.checkpoint.errors import CheckpointError
from trainloop.cli.errors import FAILURE, PROG, CliError
from trainloop.cli.settings import checked_settings
from trainloop.core.preflight import checked
from trainloop.core.result import RefusedRunError
from trainloop.core.workspace import WorkspaceBusyError

__all__ = ["command", "configure_logging"]


def command(args: argparse.Namespace) -> int:
    """Train with the settings ``args`` name; a problem is a ``CliError`` before anything is written."""
    settings, trainer_class = checked_settings(args, trainer_required=True)
    assert trainer_class is not None  # required above
    configure_logging(args.log_level)
    try:
        # A signal exit raises SystemExit(code) from train(): it propagates as the exit code.
        with checked(settings, trainer_class):  # the preflight above ran: train() does not repeat it
            trainer_class(settings).train()
    except (WorkspaceBusyError, RefusedRunError) as error:  # refused before the first step
        raise CliError(str(error), error.exit_code) from None
    except CheckpointError as error:  # a mismatch (another world size, ZeRO stage) is refused: exit 2
        raise CliError(str(error), getattr(error, "exit_code", FAILURE)) from None
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT
    return 0


def configure_logging(level: str) -> None:
    """Send log records to stderr at ``level`` unless the user's code configured logging."""
    if logging.getLogger().handlers or logging.getLogger("trainloop").handlers:
        return
    logging.basicConfig(
        level=level.upper(), stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
