"""Loading one checkpoint file safely.

``torch.load(weights_only=True)``, and the error that says whether a file was corrupt or refused (objects whose
unpickling could run code). Both formats (``trainloop.checkpoint.files``, ``trainloop.checkpoint.sharded``) read through
it; a full checkpoint's files are verified in the same read (:func:`load_verified`).
"""

from __future__ import annotations

import io
import mmap
import os
from collections.abc import Mapping
from typing import Any

import torch

from trainloop.checkpoint import storage
from trainloop.checkpoint.errors import CheckpointError
from trainloop.checkpoint.manifest import BufferReader, FileDigest, HashingReader, read_verified
from trainloop.location import Location, UrlPath

__all__ = ["SHARDED_DIR", "UnloadableError", "VerifiedFiles", "load_file", "load_verified", "refused_or_corrupt"]

SHARDED_DIR = "sharded"
"""The ``torch.distributed.checkpoint`` directory inside a sharded checkpoint."""


class UnloadableError(CheckpointError):
    """A file that matches its manifest but cannot be loaded (refused as unsafe, or unreadable by torch).

    The manifest vouches that it is what was saved, so it is an error to report, not a damaged checkpoint to skip.
    """


def load_file(path: Location) -> Any:
    """``torch.load(path, weights_only=True)`` onto the CPU (a file on object storage: downloaded first).

    Raises:
        CheckpointError: The file is corrupt, or holds objects that unpickling could run code
            with (the message names the file and what was refused).
    """
    try:
        if isinstance(path, UrlPath):
            return torch.load(io.BytesIO(storage.read_bytes(path)), map_location="cpu", weights_only=True)
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        raise refused_or_corrupt(str(path), error) from error


def load_verified(path: Location, expected: FileDigest) -> Any:
    """:func:`load_file`, but the file is checked against its manifest entry in the same read.

    torch reads the file through a :class:`~trainloop.checkpoint.manifest.HashingReader`, which
    hashes the bytes as they arrive; what was loaded is returned only if the whole file's
    checksum is its manifest's. A file that fails to load is reported as corrupt if its
    checksum differs, as unloadable otherwise. A file on object storage is downloaded and
    checked first, then loaded out of memory.

    Raises:
        CheckpointError: The file is missing, or its size or checksum is not its manifest's.
        UnloadableError: It is, but torch cannot load it or refused what it holds.
    """
    if isinstance(path, UrlPath):
        return _load_contents(path, read_verified(path, expected))
    try:
        file = open(path, "rb", buffering=0)  # closed below, after the digest
    except FileNotFoundError:
        raise CheckpointError(
            f"{path.parent} is not a complete checkpoint: missing {path.name} (listed in its manifest)"
        ) from None
    with file:
        expected.check_size(os.fstat(file.fileno()).st_size, path)
        reader = HashingReader(file, expected.checksum)
        try:
            loaded, failure = torch.load(reader, map_location="cpu", weights_only=True), None  # type: ignore[arg-type]
        except Exception as error:  # noqa: BLE001  # raised below, unless the checksum says corrupt
            loaded, failure = None, error
        problem = expected.differs(reader.finish(), path)
    if problem is not None:
        raise problem
    if failure is not None:
        raise UnloadableError(str(refused_or_corrupt(str(path), failure))) from failure
    return loaded


def _load_contents(path: Location, contents: mmap.mmap | bytes) -> Any:
    try:
        with BufferReader(contents) as reader:
            return torch.load(reader, map_location="cpu", weights_only=True)  # type: ignore[arg-type]  # copies out of the mapping
    except Exception as error:
        raise UnloadableError(str(refused_or_corrupt(str(path), error))) from error


class VerifiedFiles:
    """The files of one checkpoint, each opened once and checked against its manifest as it is read.

    A file is read (mapped and hashed: see :func:`~trainloop.checkpoint.manifest.read_verified`) the
    first time it is asked for and kept mapped until :meth:`close`, so what verification read is
    what loading reads, out of memory: no file is opened twice. A sharded resume verifies each
    rank's share up front through it, then DCP reads its pieces through it.

    Args:
        directory: The checkpoint directory.
        listing: Its manifest's entries, by path relative to ``directory``.
    """

    def __init__(self, directory: Location, listing: Mapping[str, FileDigest]) -> None:
        self.directory = directory
        self._listing = listing
        self._contents: dict[str, mmap.mmap | bytes] = {}

    def contents(self, rel: str) -> mmap.mmap | bytes:
        """The verified contents of ``rel`` (read and checked the first time).

        Raises:
            CheckpointError: ``rel`` is not in the manifest, or is missing, truncated or corrupt.
        """
        if rel not in self._contents:
            if rel not in self._listing:
                raise CheckpointError(f"{self.directory / rel}: cannot load: not listed in the checkpoint's manifest")
            self._contents[rel] = read_verified(self.directory / rel, self._listing[rel])
        return self._contents[rel]

    def open(self, rel: str) -> BufferReader:
        """A stream over the verified contents of ``rel``."""
        return BufferReader(self.contents(rel))

    def load(self, rel: str) -> Any:
        """``torch.load(weights_only=True)`` of the verified contents of ``rel``.

        Raises:
            CheckpointError: As :meth:`contents`.
            UnloadableError: It matches its manifest, but torch cannot load it or refused what it holds.
        """
        return _load_contents(self.directory / rel, self.contents(rel))

    def close(self) -> None:
        """Let every mapping go."""
        for contents in self._contents.values():
            if isinstance(contents, mmap.mmap):
                contents.close()
        self._contents.clear()


def refused_or_corrupt(what: str, error: BaseException) -> CheckpointError:
    """The error for ``what`` (a file, an entry) that ``torch.load(weights_only=True)`` failed on."""
    refused = _refusal(error)
    if refused is not None:
        return CheckpointError(
            f"{what}: refused to load: it holds objects other than tensors and plain "
            f"containers, and unpickling them could run code ({refused})"
        )
    # torch's own words can be a bare "101" (a KeyError from its unpickler): say what it means.
    said = f"{type(error).__name__}: {error}"
    return CheckpointError(f"{what}: cannot load: not a file torch.save wrote, or damaged ({said})")


def _refusal(error: BaseException) -> str | None:
    """What ``weights_only`` refused, if that is why loading failed (else ``None``)."""
    # torch's message is long and advises weights_only=False; keep only what it refused.
    text = str(error)
    if "Weights only load failed" not in text:
        return None
    marker = "WeightsUnpickler error:"
    for line in text.splitlines():
        if marker in line:
            return line.split(marker, 1)[1].split(" Please use", 1)[0].strip()
    return "weights_only=True"
