"""The package version, in a module of its own so checkpoints can record it without importing the whole package."""

__version__ = "0.1.0"
