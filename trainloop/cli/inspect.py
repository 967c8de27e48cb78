"""``trainloop inspect``: what a checkpoint holds, or why it cannot be read."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from trainloop.checkpoint import MANIFEST, METADATA, CheckpointError, latest_checkpoint
from trainloop.checkpoint.describe import describe_checkpoint, format_checkpoint, jsonable
from trainloop.checkpoint.loading import SHARDED_DIR
from trainloop.cli.errors import FAILURE, CliError

__all__ = ["command"]


def command(args: argparse.Namespace) -> int:
    """Report on the checkpoint ``args.checkpoint`` names (as text, or JSON with ``--json``)."""
    directory, root = _find_checkpoint(args.checkpoint)
    try:
        info = describe_checkpoint(directory)
    except CheckpointError as error:
        hint = _intact_alternative(root, directory) if root is not None else ""
        raise CliError(f"{error}{hint}", FAILURE) from None
    sys.stdout.write(
        json.dumps(info, indent=2, default=jsonable) + "\n" if args.json else format_checkpoint(info, root)
    )
    return 0


def _is_checkpoint(directory: Path) -> bool:
    """Whether ``directory`` looks like one checkpoint (rather than a root of several)."""
    return (
        any(directory.glob("*.pt"))
        or any((directory / name).exists() for name in (MANIFEST, METADATA, SHARDED_DIR))
    )


def _find_checkpoint(path: str) -> tuple[Path, Path | None]:
    """The checkpoint directory ``path`` names.

    Itself, or the latest under a checkpoints root (or under ``<workspace>/checkpoints``).

    Returns:
        The checkpoint directory, and the root it was found under (``None`` if given directly).

    Raises:
        CliError: Nothing there is a checkpoint.
    """
    given = Path(path)
    if not given.exists():
        raise CliError(f"{given}: no such file or directory", FAILURE)
    if not given.is_dir():
        raise CliError(f"{given}: not a directory (give a checkpoint directory or a checkpoints root)", FAILURE)
    if _is_checkpoint(given):
        return given, None
    for root in (given, given / "checkpoints"):
        # Unverified: the one `latest` names is the one to report on, intact or not.
        found = latest_checkpoint(root, verify=False)
        if found is not None:
            return found, root
    leftovers = sorted(p.name for p in given.iterdir() if p.name.startswith(".") and "-" in p.name)
    hint = f" (only an interrupted save's leftovers: {', '.join(leftovers)})" if leftovers else ""
    raise CliError(f"{given}: no checkpoint here: no checkpoint files and no complete step directory{hint}", FAILURE)


def _intact_alternative(root: Path, broken: Path) -> str:
    """Which checkpoint under ``root`` a resume would use instead of the broken one, as a hint."""
    quiet = logging.getLogger("trainloop.cli.inspect.quiet")  # the skipped ones are reported already
    if not quiet.handlers:
        quiet.addHandler(logging.NullHandler())
        quiet.propagate = False
    found = latest_checkpoint(root, verify=True, logger=quiet)
    if found is None:
        return f"; no checkpoint under {root} is intact"
    if found.resolve() == broken.resolve():
        return ""
    return f"; the newest intact checkpoint under {root} is {found}, which a resume from \"latest\" loads"
