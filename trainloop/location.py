"""Where something lives: a local path or a path on an fsspec filesystem, named without touching either.

A location is a :class:`~pathlib.Path` (local disk) or a :class:`UrlPath` (``s3://``, ``gs://``,
``memory://``: a path on an fsspec filesystem; a ``file://`` URL is a local path). Settings validate
with it, checkpoints and exports are written through it (:mod:`trainloop.checkpoint.storage` does the
I/O). fsspec and the cloud filesystems are optional extras (``trainloop[s3]``, ``trainloop[gcs]``):
without them a URL is a :class:`StorageError` naming the extra; a filesystem takes its URL's
``storage_options`` over fsspec's configuration.
"""

from __future__ import annotations

import difflib
import inspect
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, TypeAlias

__all__ = [
    "Location",
    "StorageError",
    "UnknownStorageOptions",
    "UrlPath",
    "accepted_storage_options",
    "is_url",
    "location",
    "lost_slash",
    "unknown_storage_options",
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
    unknown = unknown_storage_options(type(fs), options)
    if unknown:
        raise UnknownStorageOptions(url, type(fs), unknown)
    return UrlPath(fs, path, scheme)


def unknown_storage_options(filesystem: type, options: Mapping[str, Any]) -> list[str]:
    """The names in ``options`` that ``filesystem`` does not take (none where that cannot be told)."""
    accepted = accepted_storage_options(filesystem)
    return [] if accepted is None else [name for name in options if name not in accepted]


class UnknownStorageOptions(StorageError):
    """``storage_options`` names arguments its URL's filesystem does not take (a typo: ``endpoint_urll``).

    Attributes:
        problems: Per unknown name, its field (``storage_options.<name>``) and what is wrong with it.
    """

    def __init__(self, url: str, filesystem: type, names: list[str]) -> None:
        accepted = accepted_storage_options(filesystem) or set()
        self.problems = []
        for name in names:
            hint = difflib.get_close_matches(name, accepted, n=1)
            said = f"not an argument of {filesystem.__name__}" + (f" (did you mean {hint[0]}?)" if hint else "")
            self.problems.append((f"storage_options.{name}", said))
        super().__init__(f"{url}: " + "; ".join(f"{field}: {said}" for field, said in self.problems))


#: Where a filesystem forwards the ``**kwargs`` its ``__init__`` does not name, besides fsspec's base classes.
_FORWARDED_TO = {"s3fs.core.S3FileSystem": ("aiobotocore.session", "AioSession")}


def accepted_storage_options(filesystem: type) -> set[str] | None:
    """The keyword arguments ``filesystem`` takes, or ``None`` where that cannot be told without running it.

    Read from the signatures, with no I/O: each ``__init__`` along the class's bases, fsspec's own
    options (listing cache, instance cache), and where a filesystem is known to forward the rest
    (s3fs: to aiobotocore's session). A filesystem that takes ``**kwargs`` for another, unknown
    target is not checked.
    """
    from fsspec.asyn import AsyncFileSystem
    from fsspec.dircache import DirCache
    from fsspec.spec import AbstractFileSystem

    accepted = {"skip_instance_cache", "asynchronous", "loop", "batch_size"}
    inits: list[Any] = [DirCache.__init__]
    for klass in filesystem.__mro__:
        if "__init__" not in vars(klass) or klass in (AbstractFileSystem, AsyncFileSystem, object):
            continue
        init = vars(klass)["__init__"]
        inits.append(init)
        forwards = _FORWARDED_TO.get(f"{klass.__module__}.{klass.__qualname__}")
        if forwards is not None:
            module, name = forwards
            try:
                inits.append(vars(getattr(__import__(module, fromlist=[name]), name))["__init__"])
            except (ImportError, AttributeError, KeyError):
                return None
        elif any(p.kind is p.VAR_KEYWORD for p in inspect.signature(init).parameters.values()):
            return None  # its **kwargs go somewhere unknown
    for init in inits:
        parameters = inspect.signature(init).parameters.values()
        accepted |= {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)} - {"self"}
    return accepted
