"""``trainloop validate``: the checks of ``run``, then the resolved settings as JSON; builds and writes nothing."""

from __future__ import annotations

import argparse
import sys

from trainloop.cli.settings import checked_settings

__all__ = ["command"]


def command(args: argparse.Namespace) -> int:
    """Print the resolved settings ``args`` name, or raise ``CliError`` with what is wrong."""
    settings, _ = checked_settings(args, trainer_required=False)
    sys.stdout.write(settings.model_dump_json(indent=2) + "\n")
    return 0
