"""Choosing the checkpoint to resume from, verified by every rank at once.

A full checkpoint is verified while it is loaded: every rank loads all of it anyway, so each
checks every file as it reads it (:func:`open_checkpoint`), and nothing is read twice. For a
sharded one, the files are hashed by shares, as follows; when it is to be loaded, each rank
keeps the files it hashed mapped and DCP reads through them (:class:`VerifiedFiles`), any other
file being verified as DCP reads it: each rank opens each file once.

Rank 0 lists the candidates (the one ``latest`` points at, then the others from the highest
step down) and checks each one's listing against its manifest: names and sizes, no reading.
Then every rank hashes its share of the files and rank 0's verdict on the union is the same on
every rank. The shard files rank ``r`` wrote (``sharded/__<r>_*.distcp``) are rank ``r``'s share
(modulo the world size, when resumed on fewer ranks); the other files are spread so that every
rank reads about as many bytes. So no rank waits on the others longer than its own share takes
to read, however many ranks there are, instead of every rank waiting while rank 0 reads the
whole checkpoint.

Every rank must see the checkpoint directory (shared storage, or the same object storage): a
rank that cannot read its share refuses the checkpoint, as it could not load it either.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

from trainloop.checkpoint.deepspeed import ENGINE_DIR
from trainloop.checkpoint.errors import CheckpointError
from trainloop.checkpoint.files import read_full
from trainloop.checkpoint.loading import SHARDED_DIR, UnloadableError, VerifiedFiles
from trainloop.checkpoint.manifest import FileDigest, check_listing
from trainloop.distributed.ranks import agree_on_error, broadcast_from_rank_zero, rank, world_size
from trainloop.location import Location

__all__ = ["hash_shares", "open_checkpoint"]

logger = logging.getLogger("trainloop")

_SHARD = re.compile(r"sharded/__(\d+)_\d+\.distcp")


def hash_shares(expected: Mapping[str, FileDigest], world: int) -> list[list[str]]:
    """Which files each of ``world`` ranks hashes (the same answer on every rank).

    Args:
        expected: A manifest's entries, by relative path.
        world: The number of ranks sharing the work.
    """
    shares: list[list[str]] = [[] for _ in range(world)]
    loads = [0] * world
    others = []
    for rel, digest in sorted(expected.items()):
        match = _SHARD.fullmatch(rel)
        if match is None:
            others.append(rel)
            continue
        owner = int(match[1]) % world  # the rank that wrote it, where there is one
        shares[owner].append(rel)
        loads[owner] += digest.size
    for rel in sorted(others, key=lambda rel: (-expected[rel].size, rel)):  # largest first
        owner = min(range(world), key=lambda rank: (loads[rank], rank))
        shares[owner].append(rel)
        loads[owner] += expected[rel].size
    return shares


def open_checkpoint(
    candidates: list[Location] | None, explicit: bool, log: logging.Logger | None = None
) -> tuple[Location, dict[str, Any] | VerifiedFiles] | None:
    """The first of rank 0's ``candidates`` that every rank finds intact, read in the pass that verifies it.

    Every rank loads the whole of a full checkpoint, so every rank reads each file once,
    checks it against the manifest as it reads it, and keeps what it loaded: no file is read
    twice. A sharded checkpoint's files are hashed by shares,
    each rank keeping its share mapped for DCP to read its pieces from (the caller closes them).

    Returns:
        The checkpoint and, for a full one, its state dict (for a sharded one, its files, the
        share this rank verified held in memory); ``None`` if no candidate is intact.

    Raises:
        CheckpointError: ``explicit``, and the checkpoint is incomplete or corrupt (every rank
            raises; the message names the file); or a file matches the manifest but cannot be
            loaded or is refused (an :class:`~trainloop.checkpoint.loading.UnloadableError`, raised,
            not skipped: the manifest vouches that it is what was saved).
    """
    log = log or logger
    candidates = broadcast_from_rank_zero(candidates)
    this_rank, world = rank(), world_size()
    for candidate in candidates or []:
        listing: dict[str, FileDigest] | CheckpointError | None = None
        if this_rank == 0:
            try:
                listing = check_listing(candidate)
            except CheckpointError as refused:
                listing = refused
        listing = broadcast_from_rank_zero(listing)
        error: BaseException | None = listing if isinstance(listing, CheckpointError) else None
        state: dict[str, Any] | VerifiedFiles | None = None
        if error is None:
            assert isinstance(listing, dict)
            files = VerifiedFiles(candidate, listing)
            try:
                state = _read(files, listing, this_rank, world)
            except (CheckpointError, OSError) as failure:
                error = failure if isinstance(failure, CheckpointError) else CheckpointError(f"{candidate}: {failure}")
            error = agree_on_error(error)
            if error is None:
                assert state is not None
                return candidate, state
            files.close()
        del state  # a rank that read it fine lets it go: another rank found it bad
        if explicit or isinstance(error, UnloadableError):
            raise error  # a file the manifest vouches for but torch refuses: not to be skipped
        if this_rank == 0:
            log.warning("Skipping checkpoint %s, which is incomplete or corrupt: %s", candidate, error)
    return None


def _read(
    files: VerifiedFiles, listing: dict[str, FileDigest], this_rank: int, world: int
) -> dict[str, Any] | VerifiedFiles:
    """A full checkpoint's state dict, else ``files`` with this rank's share verified and kept."""
    if not any(rel.startswith((f"{SHARDED_DIR}/", f"{ENGINE_DIR}/")) for rel in listing):
        return read_full(files.directory, listing)
    share = hash_shares(listing, world)[this_rank]
    logger.debug(
        "Rank %d hashed %d of the %d files of %s: %s", this_rank, len(share), len(listing), files.directory, share
    )
    for rel in share:
        files.contents(rel)  # read, checked, and kept for DCP to read from
    return files
