"""Checkpoint directories: the layout, the full format, finding and reading checkpoints.

``<root>/<step>/`` is one checkpoint and ``<root>/latest`` a relative symlink to the newest (on
object storage, which has no symlinks, an object holding the newest one's step).
Both formats hold ``metadata.json`` and, written last, ``manifest.json`` (see
:mod:`trainloop.checkpoint.manifest`). Besides them:

- ``full``: one ``torch.save`` file per top-level key of ``trainer.state_dict()``:
  ``model.pt``, ``training_state.pt``, and one file per hook with state, named after its key.
- ``sharded``: ``sharded/``, a ``torch.distributed.checkpoint`` directory (model, optimizer and
  hooks' states, one file per rank), and ``training_state.pt``, the rest of the training
  state (see :mod:`trainloop.checkpoint.sharded`).

A directory only takes its step's name once complete (see :mod:`trainloop.checkpoint.storage`);
on object storage a checkpoint counts only once its manifest, written last, is there. ``root``
may be a local path or a :class:`~trainloop.checkpoint.storage.UrlPath` everywhere here.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from logging import Logger
from typing import Any

from trainloop.checkpoint import storage
from trainloop.checkpoint.deepspeed import ENGINE_DIR, read_engine_checkpoint
from trainloop.checkpoint.errors import CheckpointError, CheckpointSaveError
from trainloop.checkpoint.loading import SHARDED_DIR, VerifiedFiles, load_file, load_verified
from trainloop.checkpoint.manifest import (
    MANIFEST,
    METADATA,
    FileDigest,
    check_hashes,
    check_listing,
    make_metadata,
    save_torch,
    verify_checkpoint,
    write_json,
    write_manifest,
)
from trainloop.checkpoint.storage import (
    LATEST,
    Location,
    UrlPath,
    atomic_directory,
    is_step_name,
    location,
    remove_directory,
    replace_symlink,
)

__all__ = [
    "LATEST",
    "check_keys",
    "checkpoint_candidates",
    "checkpoint_format",
    "checkpoint_steps",
    "latest_checkpoint",
    "latest_step",
    "point_latest",
    "prune",
    "read_checkpoint",
    "read_full",
    "save_error",
    "write_checkpoint",
]


_REQUIRED = ("model", "training_state")
_FILE_KEY = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")


def check_keys(state_dict: dict[str, Any]) -> None:
    """Check that every top-level key of a trainer state dict can name a file.

    Raises:
        ValueError: A key cannot (the message names it).
    """
    for key in state_dict:
        if not _FILE_KEY.fullmatch(key):
            raise ValueError(
                f"state_dict key {key!r} cannot name a checkpoint file; use letters, digits, '_', '-', '.'"
            )


def checkpoint_steps(root: Location | str) -> list[int]:
    """The steps of the checkpoints under ``root``, ascending.

    Only a complete save gives a directory its step's name (one being written is hidden; on
    object storage, a directory without its manifest is not counted);
    whether its files are still intact, :func:`~trainloop.checkpoint.verify_checkpoint` tells.
    """
    root = location(root)
    if isinstance(root, UrlPath):
        return sorted(
            int(rel.split("/", 1)[0]) for rel in storage.files(root)
            if rel.count("/") == 1 and rel.endswith(f"/{MANIFEST}") and is_step_name(rel.split("/", 1)[0])
        )
    if not root.is_dir():
        return []
    return sorted(int(p.name) for p in root.iterdir() if is_step_name(p.name) and p.is_dir())


def latest_step(root: Location | str) -> int | None:
    """The step ``root/latest`` names, if it names a checkpoint under ``root`` (unverified)."""
    root = location(root)
    if isinstance(root, UrlPath):
        named = _named_latest(root)
        return named if named is not None and named in checkpoint_steps(root) else None
    link = root / LATEST
    if not link.is_dir():
        return None
    target = link.resolve()
    return int(target.name) if target.parent == root.resolve() and is_step_name(target.name) else None


def _named_latest(root: UrlPath) -> int | None:
    """The step the ``latest`` object under ``root`` holds, if it holds one."""
    try:
        named = storage.read_bytes(root / LATEST).decode("utf-8", "replace").strip()
    except FileNotFoundError:
        return None
    return int(named) if is_step_name(named) else None


def latest_checkpoint(
    root: Location | str, verify: bool = True, logger: Logger | None = None
) -> Location | None:
    """The newest complete checkpoint under ``root``, or ``None``.

    The one ``root/latest`` points to comes first, then the others from the highest step down.
    With ``verify``, each is checked against its manifest; one that fails is skipped with a
    warning naming it and what is wrong, and the next is tried.

    Args:
        root: The checkpoints directory.
        verify: Check the files against the manifest (hashing them); without it, the first
            candidate is returned unchecked.
        logger: Where the warnings go; ``logging.getLogger("trainloop")`` if omitted.
    """
    candidates = checkpoint_candidates(location(root), logger)
    if not verify:
        return candidates[0] if candidates else None
    for candidate in candidates:
        try:
            verify_checkpoint(candidate)
        except CheckpointError as error:
            (logger or logging.getLogger("trainloop")).warning(
                "Skipping checkpoint %s, which is incomplete or corrupt: %s", candidate, error
            )
            continue
        return candidate
    return None


def checkpoint_candidates(root: Location, logger: Logger | None = None) -> list[Location]:
    """The checkpoints under ``root`` to try resuming from, best first, unverified.

    The one ``root/latest`` points to, then the others from the highest step down.

    A ``latest`` that resolves outside ``root`` (a link into another run's checkpoints) is
    skipped with a warning: following it would resume another run's weights and step, and
    pruning would then measure this run's checkpoints against that step.
    """
    if isinstance(root, UrlPath):
        steps = checkpoint_steps(root)
        named = _named_latest(root)
        first = [named] if named in steps else []
        return [root / str(step) for step in first + [s for s in reversed(steps) if s != named]]
    candidates: list[Location] = []
    link = root / LATEST
    if link.is_dir():
        target = link.resolve()
        if target.parent == root.resolve():
            candidates.append(target)
        else:
            (logger or logging.getLogger("trainloop")).warning(
                "Ignoring %s: it points to %s, outside this run's checkpoints %s; resuming from "
                "this run's own newest checkpoint instead", link, target, root,
            )
    for step in reversed(checkpoint_steps(root)):
        path = root / str(step)
        if not candidates or path.resolve() != candidates[0]:
            candidates.append(path)
    return candidates


def save_error(target: Location, error: BaseException) -> CheckpointSaveError:
    """The error to raise when writing the checkpoint ``target`` failed with ``error``."""
    return CheckpointSaveError(f"could not save checkpoint {target}: {error}")


def write_checkpoint(
    root: Location | str, step: int, state_dict: dict[str, Any], metadata: dict[str, Any] | None = None
) -> Location:
    """Write ``state_dict`` atomically as a full checkpoint ``root/<step>/`` and point ``root/latest`` at it.

    The files (one ``<key>.pt`` per top-level key, ``metadata.json``, then ``manifest.json``)
    are written into a hidden directory, hashed as they are written, fsynced, and renamed into
    place; then ``latest`` is replaced. A crash at any moment leaves the previous checkpoint or
    the new complete one, never a half-written directory under a step name. An existing
    ``root/<step>`` is replaced the same way. If ``latest`` cannot be updated, the new
    directory is taken back out of its name (and one it replaced is put back): the save
    failed as a whole. On object storage the files are uploaded in place, the manifest last
    (what makes the checkpoint count), then ``latest``.

    Args:
        root: The checkpoints directory (created if needed), or a URL.
        step: The step, which names the directory.
        state_dict: A trainer's ``state_dict()``; each top-level key becomes one file.
        metadata: The contents of ``metadata.json``; by default made from the state's step and
            epoch (see :func:`~trainloop.checkpoint.manifest.make_metadata`).

    Returns:
        The checkpoint directory.

    Raises:
        ValueError: A top-level key cannot name a file.
        CheckpointSaveError: Writing the files or updating ``latest`` failed (disk full,
            permission denied...); nothing new is left under the step's name and the previous
            checkpoints are untouched.
    """
    check_keys(state_dict)
    if metadata is None:
        training_state = state_dict.get("training_state") or {}
        metadata = make_metadata(step, training_state.get("epoch", 0), "full")
    target = location(root) / str(step)
    try:
        # `latest` is part of the publication: if it cannot be updated, the directory is
        # taken back out of its name (and one it replaced is put back).
        with atomic_directory(target, then=lambda: point_latest(target)) as tmp:
            digests: dict[str, FileDigest] = {}
            for key, value in state_dict.items():
                digests[f"{key}.pt"] = _named(tmp / f"{key}.pt", save_torch, value)
            digests[METADATA] = _named(tmp / METADATA, write_json, metadata)
            write_manifest(tmp, digests)
    except OSError as error:
        raise save_error(target, error) from error
    return target


def point_latest(checkpoint: Location) -> None:
    """Point ``<root>/latest`` at ``checkpoint`` (``<root>/<step>``), atomically (on object storage: one upload)."""
    if isinstance(checkpoint, UrlPath):
        storage.write_bytes(checkpoint.parent / LATEST, f"{checkpoint.name}\n".encode())
    else:
        replace_symlink(checkpoint.parent / LATEST, checkpoint.name)


def _named(path: Location, write: Any, value: Any) -> FileDigest:
    """``write(value, path)``; an OS error that does not name its file is given ``path``."""
    try:
        digest: FileDigest = write(value, path)
        return digest
    except OSError as error:
        if error.filename is None:
            raise OSError(error.errno, error.strerror or str(error), str(path)) from error
        raise


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


def prune(root: Location, newest: int, keep_previous: int, kept: Callable[[int], bool], logger: Logger) -> None:
    """Remove the checkpoints under ``root`` but ``newest``, the ``keep_previous`` before it and the ``kept``.

    ``kept(step)`` keeps the best and the kept intervals. Each removed one leaves its step name
    at once and is deleted on a helper thread; a failure is logged.
    """
    earlier = [step for step in checkpoint_steps(root) if step != newest]
    recent = set(earlier[-keep_previous:]) if keep_previous else set()
    for step in earlier:
        if step in recent or kept(step):
            continue
        path = root / str(step)

        def report(error: OSError, path: Location = path) -> None:
            logger.warning("Could not remove old checkpoint %s: %s", path, error)

        try:
            remove_directory(path, background=report)  # gone from its name now, deleted off the training thread
        except OSError as error:
            report(error)
