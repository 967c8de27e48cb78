"""``trainloop report``: a run's self-contained HTML report page."""

from __future__ import annotations

import argparse
import sys

from trainloop.cli.errors import FAILURE, PROG, CliError
from trainloop.report.graphviz import GraphvizError
from trainloop.report.page import ReportError, write_report

__all__ = ["command"]


def command(args: argparse.Namespace) -> int:
    """Write the report of the workspace ``args.workspace`` names."""
    try:
        target = write_report(args.workspace, args.output, args.smoothing, args.graphviz)
    except (ReportError, GraphvizError) as error:
        raise CliError(str(error), FAILURE) from None
    except OSError as error:
        raise CliError(f"{error.filename}: cannot write: {error.strerror}", FAILURE) from None
    print(f"{PROG} report: wrote {target}", file=sys.stderr)
    return 0
