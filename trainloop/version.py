"""The package's version: what ``pip`` installs, and what checkpoints, exports and predictions record."""

__version__ = "0.1.0"
