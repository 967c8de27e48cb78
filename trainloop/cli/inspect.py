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
from trainloop.checkpoint.storage import exists, is_dir, names
from trainloop.cli.errors import FAILURE, CliError
from trainloop.location import Location, StorageError, location

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


def _is_checkpoint(directory: Location) -> bool:
    """Whether ``directory`` looks like one checkpoint (rather than a root of several)."""
    return any(name.endswith(".pt") or name in (MANIFEST, METADATA, SHARDED_DIR) for name in names(directory))


def _find_checkpoint(path: str) -> tuple[Location, Location | None]:
    """The checkpoint directory ``path`` names.

    Itself, or the latest under a checkpoints root (or under ``<workspace>/checkpoints``).

    Returns:
        The checkpoint directory, and the root it was found under (``None`` if given directly).

    Raises:
        CliError: Nothing there is a checkpoint.
    """
    try:
        given = location(path)
    except StorageError as error:
        raise CliError(str(error)) from None
    if not exists(given):
        raise CliError(f"{given}: no such file or directory", FAILURE)
    if not is_dir(given):
        raise CliError(f"{given}: not a directory (give a checkpoint directory or a checkpoints root)", FAILURE)
    if _is_checkpoint(given):
        return given, None
    for root in (given, given / "checkpoints"):
        # Unverified: the one `latest` names is the one to report on, intact or not.
        found = latest_checkpoint(root, verify=False)
        if found is not None:
            return found, root
    leftovers = [name for name in names(given) if name.startswith(".") and "-" in name]
    hint = f" (only an interrupted save's leftovers: {', '.join(leftovers)})" if leftovers else ""
    raise CliError(f"{given}: no checkpoint here: no checkpoint files and no complete step directory{hint}", FAILURE)


def _intact_alternative(root: Location, broken: Location) -> str:
    """Which checkpoint under ``root`` a resume would use instead of the broken one, as a hint."""
    quiet = logging.getLogger("trainloop.cli.inspect.quiet")  # the skipped ones are reported already
    if not quiet.handlers:
        quiet.addHandler(logging.NullHandler())
        quiet.propagate = False
    found = latest_checkpoint(root, verify=True, logger=quiet)
    if found is None:
        return f"; no checkpoint under {root} is intact"
    local = isinstance(found, Path) and isinstance(broken, Path)
    if found == broken or (local and found.resolve() == broken.resolve()):  # type: ignore[union-attr]
        return ""
    return f"; the newest intact checkpoint under {root} is {found}, which a resume from \"latest\" loads"
