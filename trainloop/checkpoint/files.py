"""Reading a checkpoint directory back: its format, and its state dict (either format).

The layout and the formats are :mod:`trainloop.checkpoint.manager`'s; a full checkpoint's files
are read (and verified against the manifest as they are read) here, a sharded one's by
:mod:`trainloop.checkpoint.sharded`. ``directory`` may be a local path or a
:class:`~trainloop.location.UrlPath` everywhere here.
"""

from __future__ import annotations

from typing import Any

from trainloop.checkpoint import storage
from trainloop.checkpoint.deepspeed import ENGINE_DIR, read_engine_checkpoint
from trainloop.checkpoint.errors import CheckpointError
from trainloop.checkpoint.loading import SHARDED_DIR, VerifiedFiles, load_file, load_verified
from trainloop.checkpoint.manifest import FileDigest, check_hashes, check_listing
from trainloop.location import Location, location

__all__ = ["checkpoint_format", "read_checkpoint", "read_full"]


_REQUIRED = ("model", "training_state")


def checkpoint_format(directory: Location | str) -> str:
    """``"sharded"``, ``"full"`` or ``"deepspeed"`` (an engine's): the format of the checkpoint in ``directory``."""
    directory = location(directory)
    if storage.is_dir(directory / ENGINE_DIR):
        return "deepspeed"
    return "sharded" if storage.is_dir(directory / SHARDED_DIR) else "full"


def read_checkpoint(directory: Location | str, verify: bool = True) -> dict[str, Any]:
    """Read a checkpoint directory back into a trainer state dict (tensors on the CPU).

    Full checkpoints are read file by file, sharded ones whole into this one process (their
    tensors reassembled from every rank's shards). Files are read with
    ``torch.load(weights_only=True)`` (and a sharded checkpoint's index with a loader that
    knows only its own classes): tensors, numbers, strings and plain containers only, so a
    checkpoint cannot run code when it is loaded.

    Args:
        directory: The checkpoint directory.
        verify: Check the files against the manifest (see
            :func:`~trainloop.checkpoint.verify_checkpoint`). Every file is checked as it is
            read, each read once, and unpickled only once it passed.

    Raises:
        CheckpointError: The checkpoint is incomplete (no valid manifest, a missing file), a
            file is truncated, corrupt or holds other objects; the message names the file.
    """
    directory = location(directory)
    listing = check_listing(directory) if verify else None
    if checkpoint_format(directory) == "deepspeed":
        return read_engine_checkpoint(directory, listing)
    if listing is None and checkpoint_format(directory) == "full":
        return read_full(directory, None)
    if listing is not None and not any(rel.startswith(f"{SHARDED_DIR}/") for rel in listing):
        return read_full(directory, listing)
    from trainloop.checkpoint.sharded import read_sharded

    if listing is None:
        return read_sharded(directory)
    files = VerifiedFiles(directory, listing)
    try:
        for rel in listing:
            files.contents(rel)  # every file checked, each read once; DCP reads out of memory
        return read_sharded(directory, files)
    finally:
        files.close()


def read_full(directory: Location, listing: dict[str, FileDigest] | None) -> dict[str, Any]:
    """Read a full checkpoint whose listing (names and sizes) was checked.

    Each file is verified against ``listing`` as it is read (unverified when ``None``).

    Raises:
        CheckpointError: As :func:`read_checkpoint`.
    """
    listed = list(listing) if listing is not None else storage.names(directory)
    files = {name.removesuffix(".pt"): directory / name for name in sorted(listed) if _is_entry(name)}
    missing = [f"{key}.pt" for key in _REQUIRED if key not in files]
    if missing:
        raise CheckpointError(f"{directory} is not a complete checkpoint: missing {', '.join(missing)}")
    if listing is None:
        return {key: load_file(path) for key, path in files.items()}
    check_hashes(directory, listing, [rel for rel in listing if not rel.endswith(".pt")])  # metadata: small
    return {key: load_verified(path, listing[path.name]) for key, path in files.items()}


def _is_entry(name: str) -> bool:
    """Whether ``name`` (directly in a checkpoint directory) is a full checkpoint's entry file."""
    return name.endswith(".pt") and "/" not in name and len(name) > len(".pt")
