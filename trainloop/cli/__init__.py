"""The ``trainloop`` command line (``trainloop --help``)."""

from trainloop.cli.main import main

__all__ = ["main"]
