"""A checkpoint's integrity: its files' checksums, taken as they are written and read, and the manifest that lists them.

``metadata.json`` (plain JSON, readable without torch) says what a checkpoint is: step, epoch,
time, format, the last metrics, versions. ``manifest.json``, written last once every other file
is complete, lists each file (relative, ``/``-separated) with its size and XXH3-128 checksum
(``xxhash``, about 12 GB/s on one core; version 1 manifests record SHA-256 and are verified the
same way). A checkpoint without a valid manifest, or whose files differ from it, is incomplete;
on object storage the manifest is what publishes one. The bytes are hashed while they are moved,
never in a pass of their own: ``HashingWriter`` as a file is written (or uploaded),
``HashingReader`` as ``torch.load`` reads it, ``read_verified`` as a file is mapped or downloaded
(docs/checkpointing.md says what the checksum guards against, and what it does not).
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import mmap
import os
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import PurePosixPath
from typing import Any, BinaryIO, Protocol

import torch
import xxhash

from trainloop.checkpoint import storage
from trainloop.checkpoint.errors import CheckpointError
from trainloop.checkpoint.storage import MANIFEST
from trainloop.location import Location, UrlPath, location
from trainloop.utils import flatten_nested_dict, to_float
from trainloop.version import __version__

__all__ = [
    "BufferReader",
    "CHECKSUM",
    "CHECKSUMS",
    "FileDigest",
    "HashingReader",
    "HashingWriter",
    "MANIFEST",
    "METADATA",
    "check_hashes",
    "check_listing",
    "hash_file",
    "make_metadata",
    "new_hash",
    "read_manifest",
    "read_metadata",
    "read_verified",
    "save_torch",
    "verify_checkpoint",
    "write_json",
    "write_manifest",
]


METADATA = "metadata.json"
#: The file of a sharded or DeepSpeed checkpoint that holds the training state beside the shards.
REST_FILE = "training_state.pt"
MANIFEST_VERSION = 2
_READABLE_VERSIONS = (1, 2)  # 1: SHA-256 entries


class _Hash(Protocol):
    def update(self, data: Any, /) -> None: ...

    def hexdigest(self) -> str: ...


CHECKSUMS = {"xxh3_128": "XXH3-128 checksum", "sha256": "SHA-256"}
"""The checksums a manifest may record (its entries' key), with the name its errors give them."""

CHECKSUM = "xxh3_128"
"""The checksum new manifests record."""


def new_hash(checksum: str = CHECKSUM) -> _Hash:
    """A fresh hash object for ``checksum`` (a key of :data:`CHECKSUMS`)."""
    return xxhash.xxh3_128() if checksum == "xxh3_128" else hashlib.new(checksum)


#: Writes and reads at least this large are hashed on the helper thread; smaller ones inline
#: (handing them over would cost more than hashing them).
_PARALLEL_MIN = 1 << 20

#: A gap this small before a read at the hashed frontier (a zip header) is read to keep hashing in order.
_GAP_MAX = 1 << 16
_CHUNK = 1 << 20  # what is read at once to hash a part of a file that was not read for loading

_HELPERS = "trainloop-hash"  # the helper threads' name (a save's own thread is "checkpoint-<step>")


@dataclass(frozen=True)
class FileDigest:
    """A file's size in bytes and its checksum (hex), of the kind ``checksum`` names."""

    size: int
    hex: str
    checksum: str = CHECKSUM

    def check_size(self, size: int, path: Location) -> None:
        """Raise the error for ``path`` if ``size`` is not this digest's."""
        if size != self.size:
            said = f"{size} bytes; its manifest says {self.size}"
            raise CheckpointError(f"{path}: cannot load: truncated or altered ({said})")

    def differs(self, actual: FileDigest, path: Location) -> CheckpointError | None:
        """The error for ``path`` if ``actual`` (computed the same way) is not this digest, else ``None``."""
        if actual.hex == self.hex:
            return None
        kind = CHECKSUMS[self.checksum]
        return CheckpointError(f"{path}: cannot load: corrupt (its {kind} differs from its manifest's)")


class HashingWriter(io.RawIOBase):
    """A binary file that hashes what is written through it, so a file is never read back.

    Large writes are hashed on a helper thread while this one copies them to the file, and
    the file is pushed to disk in the background as it grows (see the module docstring), if
    it is on a disk (an upload to object storage has no file descriptor).
    ``error`` keeps the operating system's error of a failed write, which torch's writer
    would otherwise turn into a RuntimeError about positions.
    """

    def __init__(self, file: BinaryIO) -> None:
        super().__init__()
        self._file = file
        self._hash = new_hash()
        self._size = 0
        self._syncing: Future[None] | None = None
        self._helpers: ThreadPoolExecutor | None = None  # made at the first large write
        self.error: OSError | None = None
        try:
            self._fd: int | None = file.fileno()
        except (AttributeError, OSError):  # io.UnsupportedOperation is an OSError
            self._fd = None

    def writable(self) -> bool:
        """True: this file is written to."""
        return True

    def write(self, data: Any) -> int:
        """Write ``data`` to the file, hashing it on the way; return the number of bytes written."""
        view = memoryview(data).cast("B")
        if view.nbytes < _PARALLEL_MIN:
            self._hash.update(view)
            self._write(view)
        else:
            if self._helpers is None:
                self._helpers = ThreadPoolExecutor(max_workers=2, thread_name_prefix=_HELPERS)
            hashing = self._helpers.submit(self._hash.update, view)
            try:
                self._write(view)
            finally:
                hashing.result()  # the caller may free the buffer once write() returns
            self._push_to_disk()
        self._size += view.nbytes
        return view.nbytes

    def _write(self, view: memoryview) -> None:
        try:
            self._file.write(view)
        except OSError as error:
            self.error = error
            raise

    def _push_to_disk(self) -> None:
        """Start writing the file's dirty pages to disk, unless a push is still under way."""
        if self._fd is None:
            return
        if self._syncing is None or self._syncing.done():
            self._check_sync()
            self._file.flush()
            assert self._helpers is not None
            self._syncing = self._helpers.submit(os.fdatasync, self._fd)

    def _check_sync(self) -> None:
        syncing, self._syncing = self._syncing, None
        if syncing is not None:
            try:
                syncing.result()
            except OSError as error:
                self.error = error
                raise

    def tell(self) -> int:
        """The position in the file."""
        return self._file.tell()

    def fileno(self) -> int:
        """The file's descriptor."""
        return self._file.fileno()

    def flush(self) -> None:
        """Flush the file's buffer."""
        self._file.flush()

    def close(self) -> None:
        """Wait for the background push (its error, e.g. disk full, raises here); end the helpers."""
        try:
            self._check_sync()
        finally:
            if self._helpers is not None:
                self._helpers.shutdown()
                self._helpers = None
            super().close()

    def digest(self) -> FileDigest:
        """The size and checksum of everything written (after :meth:`close`)."""
        return FileDigest(self._size, self._hash.hexdigest())


class _Reader(io.RawIOBase):
    """A read-only, seekable file of ``size`` bytes that keeps its own position (subclasses read)."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self._size = size
        self._pos = 0

    def readable(self) -> bool:
        """True: this file is read."""
        return True

    def seekable(self) -> bool:
        """True: any position can be read."""
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        """Move to ``offset`` from ``whence``; return the new position."""
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        """The position in the file."""
        return self._pos


class HashingReader(_Reader):
    """A file that ``torch.load`` reads while it is hashed: every byte once, in order, no second pass.

    torch reads a checkpoint (a zip) in a known pattern: its directory at the end first, then
    from the start each record's header and data, in order. So the hash follows a frontier: a
    read that starts at it (or just after it: the gap, a header, is read and hashed first) is
    hashed out of the caller's buffer, the large tensor data straight after the kernel copied
    it there; reads behind it are already hashed, reads far ahead of it (the directory) are
    left for :meth:`finish`, which hashes what lies beyond the frontier at the end.

    Args:
        file: The file, opened for reading without buffering.
        checksum: The kind of checksum (a key of :data:`CHECKSUMS`).
    """

    def __init__(self, file: BinaryIO, checksum: str) -> None:
        super().__init__(os.fstat(file.fileno()).st_size)
        self._fd = file.fileno()
        if hasattr(os, "posix_fadvise"):  # read front to back: a larger read-ahead for a cold file
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        self._hashed = 0  # every byte before this offset is hashed
        self._hash = new_hash(checksum)

    def readinto(self, target: Any) -> int:
        """Read the next bytes into ``target``, hashing them if they extend the hashed part; return how many."""
        out = memoryview(target).cast("B")
        count = os.preadv(self._fd, [out], self._pos)
        start, end = max(self._pos, self._hashed), self._pos + count
        if start - self._hashed <= _GAP_MAX and end > start:
            self._hash_range(self._hashed, start)
            self._hash.update(out[start - self._pos : count])
            self._hashed = end
        self._pos = end
        return count

    def _hash_range(self, start: int, end: int) -> None:
        while start < end:
            chunk = os.pread(self._fd, min(end - start, _CHUNK), start)
            if not chunk:
                break  # the file shrank: the digest will differ
            self._hash.update(chunk)
            start += len(chunk)

    def finish(self) -> FileDigest:
        """Hash the rest of the file (what was not read in order) and return its size and checksum."""
        self._hash_range(self._hashed, self._size)
        self._hashed = self._size
        return FileDigest(self._size, self._hash.hexdigest())


def read_verified(path: Location, expected: FileDigest) -> mmap.mmap | bytes:
    """The contents of ``path``, mapped into memory, read once and checked against its manifest entry.

    Hashing the mapping reads the file; the kernel reads ahead while it hashes. Load from it with :class:`BufferReader`,
    then close it. A file on object storage is downloaded whole into memory, then hashed there.

    Raises:
        CheckpointError: The file is missing, or its size or checksum differs (the message
            names it).
    """
    if isinstance(path, UrlPath):
        return _download_verified(path, expected)
    try:
        with open(path, "rb", buffering=0) as file:
            size = os.fstat(file.fileno()).st_size
            expected.check_size(size, path)
            if size == 0:
                contents: mmap.mmap | bytes = b""
            else:
                contents = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
                contents.madvise(mmap.MADV_WILLNEED)  # read the whole file ahead, asynchronously
    except FileNotFoundError:
        raise CheckpointError(
            f"{path.parent} is not a complete checkpoint: missing {path.name} (listed in its manifest)"
        ) from None
    hashing = new_hash(expected.checksum)
    hashing.update(contents)
    problem = expected.differs(FileDigest(size, hashing.hexdigest(), expected.checksum), path)
    if problem is not None:
        if isinstance(contents, mmap.mmap):
            contents.close()
        raise problem
    return contents


def _download_verified(path: UrlPath, expected: FileDigest) -> bytes:
    try:
        contents = storage.read_bytes(path)
    except FileNotFoundError:
        raise CheckpointError(
            f"{path.parent} is not a complete checkpoint: missing {path.name} (listed in its manifest)"
        ) from None
    expected.check_size(len(contents), path)
    hashing = new_hash(expected.checksum)
    hashing.update(contents)
    problem = expected.differs(FileDigest(len(contents), hashing.hexdigest(), expected.checksum), path)
    if problem is not None:
        raise problem
    return contents


class BufferReader(_Reader):
    """A read-only, seekable file over a buffer (a mapped file), without copying it, for ``torch.load``."""

    def __init__(self, buffer: mmap.mmap | bytes | bytearray) -> None:
        view = memoryview(buffer)
        super().__init__(view.nbytes)
        self._view = view

    def readinto(self, target: Any) -> int:
        """Copy the next bytes of the buffer into ``target``; return how many were copied."""
        out = memoryview(target).cast("B")
        count = min(out.nbytes, self._view.nbytes - self._pos)
        out[:count] = self._view[self._pos : self._pos + count]
        self._pos += count
        return count

    def close(self) -> None:
        """Release the view of the buffer."""
        self._view.release()
        super().close()

def save_torch(obj: Any, path: Location) -> FileDigest:
    """``torch.save(obj, path)``, hashing the bytes on their way to the file.

    See :class:`~trainloop.checkpoint.manifest.HashingWriter`.
    """
    with storage.writing(path) as file:
        hashing = HashingWriter(file)
        try:
            torch.save(obj, hashing)  # type: ignore[arg-type]  # a file object in all but name
            hashing.close()
        except RuntimeError:
            # torch's writer turns a failed write (disk full...) into a RuntimeError about
            # positions; the OS error is what tells the user what happened.
            if hashing.error is not None:
                raise hashing.error from None
            raise
        finally:
            hashing.close()
    return hashing.digest()


def write_json(obj: Any, path: Location) -> FileDigest:
    """Write ``obj`` as indented JSON (strict: no NaN) and return the file's digest."""
    data = (json.dumps(obj, indent=2, allow_nan=False) + "\n").encode("utf-8")
    with storage.writing(path) as file:
        file.write(data)
    hashing = new_hash()
    hashing.update(data)
    return FileDigest(len(data), hashing.hexdigest())


def hash_file(path: Location, checksum: str = CHECKSUM) -> FileDigest:
    """The size and checksum of a file (the one new manifests record, unless ``checksum`` names another)."""
    hashing = new_hash(checksum)
    size = 0
    with storage.reading(path) as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            hashing.update(chunk)
            size += len(chunk)
    return FileDigest(size, hashing.hexdigest(), checksum)


def make_metadata(step: int, epoch: int, format: str, metrics: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The contents of ``metadata.json`` for a checkpoint made now.

    Args:
        step: The checkpoint's step.
        epoch: The data loader's epoch at that step.
        format: ``"full"`` or ``"sharded"``.
        metrics: The last logged records, flattened (``"a/b"`` keys); values that are not
            numbers are left out, non-finite ones are written as ``null`` (JSON has no NaN).
    """
    metadata: dict[str, Any] = {
        "step": step,
        "epoch": epoch,
        "time": datetime.now(UTC).isoformat(timespec="seconds"),
        "format": format,
    }
    if metrics:
        metadata["metrics"] = _as_floats(metrics)
    metadata["trainloop_version"] = __version__
    metadata["torch_version"] = torch.__version__
    return metadata


def _as_floats(metrics: Mapping[str, Any]) -> dict[str, float | None]:
    floats: dict[str, float | None] = {}
    for key, value in flatten_nested_dict(metrics).items():
        try:
            number = to_float(value, key)  # a host sync for a tensor: only ever at a save
        except (TypeError, ValueError):
            continue
        floats[key] = number if math.isfinite(number) else None
    return floats


def write_manifest(directory: Location, known: Mapping[str, FileDigest] | None = None) -> None:
    """Write ``directory/manifest.json`` listing every other file in ``directory``; call it last.

    Args:
        directory: The checkpoint directory, complete but for its manifest.
        known: Digests already computed while writing, by relative path; other files are hashed.
            Every one of them is listed, even if this process does not see its file (written
            by another rank): then the checkpoint fails verification here, as it should.
    """
    known = dict(known or {})
    for rel in storage.files(directory):
        if rel != MANIFEST and rel not in known:
            known[rel] = hash_file(directory / rel)
    files = {rel: {"size": known[rel].size, known[rel].checksum: known[rel].hex} for rel in sorted(known)}
    write_json({"manifest_version": MANIFEST_VERSION, "files": files}, directory / MANIFEST)


def verify_checkpoint(directory: Location | str) -> dict[str, FileDigest]:
    """Check that ``directory`` is a complete checkpoint: its files match its manifest.

    Sizes are compared first (a truncated file is found without hashing), then every file is
    hashed. (Several ranks can share the hashing: see :mod:`trainloop.checkpoint.verify`.)

    Returns:
        The manifest's entries, by relative path.

    Raises:
        CheckpointError: No manifest, an invalid one, or a file missing, truncated, corrupt or
            not listed; the message names the file.
    """
    directory = location(directory)
    expected = check_listing(directory)
    check_hashes(directory, expected, expected)
    return expected


def read_manifest(directory: Location | str) -> dict[str, FileDigest]:
    """The entries of ``directory``'s manifest, by relative path.

    Raises:
        CheckpointError: No checkpoint directory, no manifest, or an invalid one.
    """
    directory = location(directory)
    manifest_path = directory / MANIFEST
    try:
        raw = storage.read_bytes(manifest_path)
    except (FileNotFoundError, NotADirectoryError):
        if not storage.is_dir(directory):
            raise CheckpointError(f"{directory}: no checkpoint directory there") from None
        raise CheckpointError(
            f"{directory} is not a complete checkpoint: it has no {MANIFEST} (written last, so its "
            "save did not finish, or a trainloop without manifests wrote it)"
        ) from None
    return _parse_manifest(manifest_path, raw)


def check_listing(directory: Location | str) -> dict[str, FileDigest]:
    """Check, without hashing, that ``directory`` holds exactly its manifest's files, at their sizes.

    One listing of the directory (one request on object storage) gives every size.

    Returns:
        The manifest's entries, by relative path.

    Raises:
        CheckpointError: As :func:`verify_checkpoint`, but for corrupt contents.
    """
    directory = location(directory)
    expected = read_manifest(directory)
    found = storage.files(directory)
    for rel, digest in expected.items():
        if rel not in found:
            raise CheckpointError(f"{directory} is not a complete checkpoint: missing {rel} (listed in its manifest)")
        digest.check_size(found[rel], directory / rel)
    for rel in found:
        if rel != MANIFEST and rel not in expected:
            raise CheckpointError(
                f"{directory / rel}: not listed in {directory / MANIFEST}; the checkpoint was altered"
            )
    return expected


def check_hashes(directory: Location, expected: Mapping[str, FileDigest], files: Iterable[str]) -> None:
    """Hash ``files`` (relative paths) of ``directory`` and compare them with ``expected``.

    Raises:
        CheckpointError: A file is missing or its checksum differs (the message names it).
    """
    for rel in files:
        path = directory / rel
        try:
            actual = hash_file(path, expected[rel].checksum)
        except FileNotFoundError:
            raise CheckpointError(
                f"{directory} is not a complete checkpoint: missing {rel} (listed in its manifest)"
            ) from None
        problem = expected[rel].differs(actual, path)
        if problem is not None:
            raise problem


def _parse_manifest(path: Location, raw: bytes) -> dict[str, FileDigest]:
    try:
        manifest = json.loads(raw)
        version = manifest["manifest_version"]
        if version not in _READABLE_VERSIONS:
            raise ValueError(f"manifest_version {version!r} is not one of {_READABLE_VERSIONS}")
        checksum = "sha256" if version == 1 else "xxh3_128"
        files = {}
        for rel, entry in manifest["files"].items():
            parts = PurePosixPath(rel).parts
            if not parts or rel.startswith("/") or ".." in parts:
                raise ValueError(f"{rel!r} is not a path inside the checkpoint")
            size, value = entry["size"], entry[checksum]
            if not isinstance(size, int) or not isinstance(value, str):
                raise TypeError(f"the entry of {rel!r} is not a size and a {CHECKSUMS[checksum]}")
            files[rel] = FileDigest(size, value, checksum)
    except (ValueError, TypeError, KeyError, AttributeError) as error:
        raise CheckpointError(f"{path}: not a valid manifest ({type(error).__name__}: {error})") from None
    return files


def read_metadata(directory: Location | str) -> dict[str, Any]:
    """The contents of a checkpoint's ``metadata.json`` (plain JSON, no torch needed).

    Raises:
        CheckpointError: The file is missing or not a JSON object; the message names it.
    """
    path = location(directory) / METADATA
    try:
        metadata = json.loads(storage.read_bytes(path))
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{path}: cannot read the checkpoint's metadata ({error})") from None
    if not isinstance(metadata, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    return metadata
