"""Where checkpoints live: a local path, or a path on object storage named by an fsspec URL.

A location is a :class:`~pathlib.Path` (local disk: the fast path, with renames, symlinks, fsync
and memory-mapped reads) or a :class:`UrlPath` (``s3://``, ``gs://``, ``memory://``...: a path
on an fsspec filesystem). A ``file://`` URL is a local path. The checkpoint code is written once
over both: the operations that differ are here, and publication (no rename on object storage) in
:mod:`trainloop.checkpoint.atomic`.

fsspec and the cloud filesystems are optional extras (``trainloop[s3]``, ``trainloop[gcs]``):
without them a URL is a :class:`StorageError` naming the extra. A filesystem takes the
``storage_options`` declared with its URL, over fsspec's own configuration (``fsspec.config.conf``,
the ``FSSPEC_<PROTOCOL>_<OPTION>`` environment variables), which fsspec applies itself.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO, TypeAlias

__all__ = [
    "Location",
    "StorageError",
    "UrlPath",
    "exists",
    "file_size",
    "files",
    "is_dir",
    "is_file",
    "is_url",
    "location",
    "lost_slash",
    "names",
    "read_bytes",
    "reading",
    "remove",
    "write_bytes",
    "writing",
]

#: ``s3://``, ``gs://``, ``memory://``, ``file://``, chained ``simplecache::s3://``: an fsspec URL.
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*(::[A-Za-z][A-Za-z0-9+.\-]*)*://")
_SCHEME_ONLY = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]+:")

#: The extra that installs each protocol's filesystem.
_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}


def is_url(value: object) -> bool:
    """Whether ``value`` is a string written as a URL (``scheme://...``), which names no local path."""
    return isinstance(value, str) and _URL.match(value) is not None


def lost_slash(path: Path) -> str | None:
    """Why a local ``path`` beginning ``s3:/`` (a URL that lost a ``/``, as Path writes it) is refused, or None."""
    first = path.parts[0] if path.parts else ""
    if _SCHEME_ONLY.fullmatch(first) is None:
        return None
    return (
        f"{str(path)!r} begins with {first!r}, a URL scheme without its '//' (a Path made of a URL loses one "
        f"'/'): write the URL as text, {first}//..."
    )


class StorageError(ValueError):
    """A URL that cannot be used here (its filesystem is not installed, an unknown protocol); names the URL."""


@dataclass(frozen=True)
class UrlPath:
    """A file or directory on an fsspec filesystem: the part of the ``Path`` API checkpoints use.

    Attributes:
        fs: The filesystem (fsspec caches one instance per protocol and options).
        path: The path as ``fs`` names it (``bucket/run/5`` for S3).
        scheme: The protocol the URL was written with (``s3``), for :meth:`__str__`.
    """

    fs: Any
    path: str
    scheme: str

    def __truediv__(self, name: str) -> UrlPath:
        return UrlPath(self.fs, f"{self.path.rstrip('/')}/{name}", self.scheme)

    @property
    def name(self) -> str:
        """The last part of the path."""
        return self.path.rstrip("/").rsplit("/", 1)[-1]

    @property
    def suffix(self) -> str:
        """The extension of :attr:`name` (``.safetensors``)."""
        return PurePosixPath(self.name).suffix

    @property
    def parent(self) -> UrlPath:
        """The directory holding this path."""
        return UrlPath(self.fs, self.path.rstrip("/").rsplit("/", 1)[0], self.scheme)

    def __str__(self) -> str:
        return f"{self.scheme}://{self.path.lstrip('/')}"


Location: TypeAlias = Path | UrlPath
"""A local path or a path on object storage."""


def location(value: str | Path | UrlPath, storage_options: Mapping[str, Any] | None = None) -> Location:
    """The location ``value`` names: a URL's fsspec path, else a local path (``~`` expanded).

    Args:
        value: A path, or a URL (``s3://bucket/run``; ``file://`` gives a local path).
        storage_options: Passed to the URL's filesystem as given (``{"endpoint_url": ...}``),
            over fsspec's configuration; unused for a local path.

    Raises:
        StorageError: The URL's filesystem is not installed, or fsspec does not know its
            protocol; or ``value`` is a local path that begins like a URL that lost a ``/``.
    """
    if isinstance(value, UrlPath):
        return value
    if is_url(value):
        assert isinstance(value, str)
        scheme, rest = value.split("://", 1)
        if scheme == "file":
            return Path(os.path.abspath(os.path.expanduser(rest)))
        return _open_url(value, scheme, dict(storage_options or {}))
    path = Path(value).expanduser()
    problem = lost_slash(path)
    if problem is not None:
        raise StorageError(problem)
    return path


def _open_url(url: str, scheme: str, options: dict[str, Any]) -> UrlPath:
    protocol = scheme.rsplit("::", 1)[-1]
    extra = _EXTRAS.get(protocol)
    install = f"pip install 'trainloop[{extra}]'" if extra else "pip install fsspec and the filesystem for it"
    try:
        from fsspec.core import url_to_fs
    except ImportError:
        raise StorageError(f"{url}: a URL needs fsspec, which is not installed: {install}") from None
    try:
        fs, path = url_to_fs(url, **options)
    except ImportError as error:  # fsspec knows the protocol, its package is missing
        raise StorageError(f"{url}: the {protocol}:// filesystem is not installed: {install} ({error})") from None
    except (ValueError, TypeError) as error:
        raise StorageError(f"{url}: {error}") from None
    return UrlPath(fs, path, scheme)


def _fresh(where: UrlPath) -> Any:
    """``where``'s filesystem, its cached listings of ``where`` dropped (another process may have written there)."""
    where.fs.invalidate_cache(where.path)
    return where.fs


def is_dir(where: Location) -> bool:
    """Whether ``where`` is a directory (on object storage: a prefix that holds something)."""
    return where.is_dir() if isinstance(where, Path) else bool(_fresh(where).isdir(where.path))


def is_file(where: Location) -> bool:
    """Whether ``where`` is a file (an object)."""
    return where.is_file() if isinstance(where, Path) else bool(_fresh(where).isfile(where.path))


def exists(where: Location) -> bool:
    """Whether anything is at ``where``."""
    return where.exists() if isinstance(where, Path) else bool(_fresh(where).exists(where.path))


def names(directory: Location) -> list[str]:
    """The names directly under ``directory``, sorted (none if it is not a directory)."""
    if isinstance(directory, Path):
        return sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []
    try:
        found = _fresh(directory).ls(directory.path, detail=False)
    except (FileNotFoundError, NotADirectoryError):
        return []
    prefix = directory.path.rstrip("/") + "/"
    return sorted(str(p).rstrip("/").rsplit("/", 1)[-1] for p in found if str(p).startswith(prefix))


def files(directory: Location) -> dict[str, int]:
    """Every file under ``directory``, at any depth: its size by ``/``-separated relative path."""
    if isinstance(directory, Path):
        return {
            p.relative_to(directory).as_posix(): p.stat().st_size
            for p in sorted(directory.rglob("*"))
            if p.is_file()
        }
    prefix = directory.path.rstrip("/") + "/"
    found = _fresh(directory).find(directory.path, detail=True)
    return {
        str(path)[len(prefix):]: int(info.get("size") or 0)
        for path, info in sorted(found.items())
        if str(path).startswith(prefix) and info.get("type", "file") == "file"
    }


def file_size(where: Location) -> int:
    """The size of the file at ``where``, in bytes.

    Raises:
        FileNotFoundError: There is none.
    """
    if isinstance(where, Path):
        return where.stat().st_size
    info = _fresh(where).info(where.path)
    if info.get("type") != "file":
        raise FileNotFoundError(2, "not a file", str(where))
    return int(info.get("size") or 0)


def read_bytes(where: Location) -> bytes:
    """The whole contents of the file at ``where`` (one download on object storage).

    Raises:
        FileNotFoundError: There is none.
    """
    return where.read_bytes() if isinstance(where, Path) else bytes(where.fs.cat_file(where.path))


def write_bytes(where: Location, data: bytes) -> None:
    """Replace the file at ``where`` with ``data`` whole: a reader sees the old or the new contents.

    Locally through a hidden temporary file and a rename; on object storage in one upload, which
    the store makes visible whole.
    """
    if isinstance(where, UrlPath):
        where.fs.pipe_file(where.path, data)
        return
    tmp = where.with_name(f".{where.name}.tmp")
    tmp.write_bytes(data)
    tmp.replace(where)


@contextmanager
def writing(where: Location) -> Iterator[BinaryIO]:
    """A binary file to write at ``where`` (locally, its directory must exist).

    On object storage the object appears once the file is closed, whole (where the store is
    made so: S3 and GCS are); after an exception the upload is abandoned where the filesystem
    can (an S3 multipart upload is aborted). No bucket is ever created.
    """
    if isinstance(where, Path):
        with open(where, "wb") as file:
            yield file
        return
    stream = where.fs.open(where.path, "wb")
    try:
        yield stream
    except BaseException:
        discard = getattr(stream, "discard", None)
        if discard is None:
            stream.close()
        else:
            discard()  # an unfinished upload is never committed (an S3 multipart upload is aborted)
            with suppress(AttributeError):
                stream.closed = True  # and never completed by a later close()
        raise
    stream.close()


@contextmanager
def reading(where: Location) -> Iterator[BinaryIO]:
    """The file at ``where``, opened to read.

    Raises:
        FileNotFoundError: There is none.
    """
    if isinstance(where, Path):
        with open(where, "rb") as file:
            yield file
        return
    with where.fs.open(where.path, "rb") as stream:
        yield stream


def remove(where: Location) -> None:
    """Remove the file or the directory (with all it holds) at ``where``; nothing there is no error."""
    if isinstance(where, Path):
        import shutil

        if where.is_dir() and not where.is_symlink():  # rmtree refuses symlinks: never follow one out
            shutil.rmtree(where)
        else:
            where.unlink(missing_ok=True)
        return
    fs = _fresh(where)
    try:
        fs.rm(where.path, recursive=True)
    except FileNotFoundError:
        pass
