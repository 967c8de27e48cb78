"""Checksums of checkpoint files, computed in the same pass that writes or reads them.

A checkpoint's manifest records each file's size and XXH3-128 checksum (``xxhash``): a 128-bit
hash made to detect corrupted data, at about 12 GB/s on one core here, ten times a copy out of
the page cache. SHA-256 (what manifests recorded before, and still verified in them) runs at
about 1.4 GB/s, no faster than the disk: it was most of a warm resume's time and a large part of
a save's. The checksum guards against damage (a truncated, flipped or partly written file), not
against a forger, who could rewrite the manifest beside the file whatever its hash; loading
refuses unsafe pickles on its own (``weights_only=True``).

The bytes are hashed while they are moved, never in a pass of their own (``xxhash``, ``hashlib``
and file I/O all release the GIL on large buffers):

- :class:`HashingWriter`: each large write is hashed on a helper thread while it is copied to
  the page cache, and the file's data is pushed to disk (``fdatasync``) on another, so the
  hash overlaps the disk's own time and the final fsync finds little left to do.
- :class:`HashingReader`: ``torch.load`` reads a full checkpoint's file through it; the kernel
  copies each tensor's bytes straight into its storage and they are hashed there, cache-hot.
  What was loaded is used only once the whole file's checksum matched.
- :func:`read_verified`: maps a file into memory and hashes it (which reads it, once, the
  kernel reading ahead meanwhile), and compares size and digest with the manifest's before
  anything is unpickled; DCP then reads a sharded checkpoint's pieces out of the mapping.

On object storage a file is written through :class:`HashingWriter` as it is uploaded (there is
no disk to push to), and read whole into memory, once, by :func:`read_verified`.
"""

from __future__ import annotations

import hashlib
import io
import mmap
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, BinaryIO, Protocol

import xxhash

from trainloop.checkpoint import storage
from trainloop.checkpoint.errors import CheckpointError
from trainloop.checkpoint.storage import Location, UrlPath

__all__ = [
    "CHECKSUM",
    "CHECKSUMS",
    "BufferReader",
    "FileDigest",
    "HashingReader",
    "HashingWriter",
    "new_hash",
    "read_verified",
]


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
