"""I/O at a location, and replacing a directory or a file there at once: a reader sees the old or the new.

A location (:mod:`trainloop.location`) is a local :class:`~pathlib.Path` (the fast path, with
renames, symlinks, fsync and memory-mapped reads) or a :class:`~trainloop.location.UrlPath` on an
fsspec filesystem. The checkpoint code is written once over both; the operations that differ are
here.

Locally, work in progress lives beside its target under a hidden name ``.<name>.<kind>-<hex>``
(``tmp`` being written, ``old`` moved aside for a new one, ``del`` being deleted) and is renamed
into place. Object storage has no rename: a directory is written in place and counts once its
manifest, written last, is there, and is removed manifest first. :func:`clean_leftovers` settles
what a crash left behind (one writer per parent directory).
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, suppress
from logging import Logger
from pathlib import Path
from typing import Any, BinaryIO

from trainloop.location import Location, UrlPath

__all__ = [
    "LATEST",
    "MANIFEST",
    "atomic_file",
    "clean_leftovers",
    "discard",
    "drop_replaced",
    "exists",
    "file_size",
    "files",
    "is_dir",
    "is_file",
    "is_step_name",
    "make_temporary",
    "names",
    "publish",
    "read_bytes",
    "reading",
    "remove",
    "remove_directory",
    "unpublish",
    "replace_symlink",
    "wait_for_removals",
    "write_bytes",
    "writing",
]

MANIFEST = "manifest.json"
"""The file written last into a checkpoint: on object storage, what makes it count."""

LATEST = "latest"
"""The entry of a checkpoints root that names its newest checkpoint."""

#: A checkpoint's name: its step, written as ``str(step)`` (never a leading zero).
_STEP_NAME = re.compile(r"0|[1-9][0-9]*")


def is_step_name(name: str) -> bool:
    """Whether ``name`` is a checkpoint's step, as a save names it (``7``; not ``0007``, ``07`` or ``²``)."""
    return _STEP_NAME.fullmatch(name) is not None


def _saved_name(name: str) -> bool:
    """Whether a save writes the entry ``name`` of a checkpoints root: a step, or ``latest``."""
    return name == LATEST or is_step_name(name)




_HIDDEN = re.compile(r"\.(?P<name>.+)\.(?P<kind>tmp|old|del)-[0-9a-f]+")


def _hidden_name(path: Path, kind: str) -> Path:
    return path.with_name(f".{path.name}.{kind}-{secrets.token_hex(4)}")


def _fsync(path: Path) -> None:
    """Flush a file's or a directory's entries to disk (a directory: the names it holds)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: Location) -> None:
    if isinstance(path, UrlPath):
        _remove_url_directory(path)
    # rmtree refuses symlinks on purpose: never follow one into data outside the tree.
    elif path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def _remove_url_directory(directory: UrlPath) -> None:
    """Remove a directory on object storage: its manifest first (it stops counting at once), then the rest."""
    remove(directory / MANIFEST)
    remove(directory)


@contextmanager
def atomic_file(target: Location) -> Iterator[Path]:
    """Yield a temporary local path to write one file at; on success it is fsynced and renamed to ``target``.

    An existing ``target`` is replaced in one rename (it stays whole until then); on an exception
    the temporary file is removed and ``target`` is untouched. The parent is created if needed.
    On object storage the file is written in a local temporary directory, then uploaded.
    """
    if isinstance(target, UrlPath):
        with tempfile.TemporaryDirectory(prefix="trainloop-upload-") as local:
            tmp = Path(local) / target.name
            yield tmp
            target.fs.put_file(str(tmp), target.path)
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = _hidden_name(target, "tmp")
    try:
        yield tmp
        # A writer may have made its file private (safetensors writes 0600): give it the mode a
        # new file gets here, so that a team's shared directory can read it.
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)
        _fsync(tmp)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def make_temporary(target: Location) -> Location:
    """Create the hidden, empty directory that will become ``target`` (its parent if needed).

    Fill it (from one process or several, on this thread or another), then hand it to
    :func:`publish` when complete, or to :func:`discard`.

    On object storage, where nothing can be renamed, it is ``target`` itself, emptied: a
    directory there already (a checkpoint of the same step) is removed first, manifest first.
    """
    if isinstance(target, UrlPath):
        _remove_url_directory(target)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = _hidden_name(target, "tmp")
    tmp.mkdir()
    return tmp


def publish(tmp: Location, target: Location) -> Location | None:
    """Fsync everything in ``tmp`` and rename it to ``target``; return the directory it replaced, moved aside.

    The replaced directory stays hidden beside ``target`` until :func:`drop_replaced` removes it, or
    :func:`unpublish` puts it back (a step the publication needs, such as pointing ``latest``, failed);
    a crash in between is settled by :func:`clean_leftovers`.

    Args:
        tmp: The complete directory, from :func:`make_temporary`.
        target: Its name once published.

    On object storage ``tmp`` is ``target``, which its manifest published already: nothing is
    renamed, nothing replaced.
    """
    if isinstance(tmp, UrlPath):
        return None
    assert isinstance(target, Path)
    for path in tmp.rglob("*"):
        _fsync(path)
    _fsync(tmp)
    # POSIX rename cannot replace a non-empty directory, so the old one steps aside first.
    old = None
    if target.exists() or target.is_symlink():
        old = _hidden_name(target, "old")
        os.rename(target, old)
    try:
        os.rename(tmp, target)
    except BaseException:
        if old is not None:
            os.rename(old, target)
        raise
    _fsync(target.parent)
    return old


def unpublish(target: Location, replaced: Location | None) -> None:
    """Take the just-published ``target`` back out of its name, and put ``replaced`` back there.

    On object storage ``target`` is removed, manifest first.
    """
    if isinstance(target, UrlPath):
        _remove_url_directory(target)
        return
    gone = _hidden_name(target, "del")
    os.rename(target, gone)
    if isinstance(replaced, Path):
        os.rename(replaced, target)
    _fsync(target.parent)
    shutil.rmtree(gone, ignore_errors=True)  # what stays hidden, clean_leftovers removes


def drop_replaced(replaced: Location | None) -> None:
    """Remove the directory :func:`publish` moved aside; what cannot be removed now, :func:`clean_leftovers` retries."""
    if replaced is None:
        return
    try:
        _remove(replaced)
    except OSError:
        pass


def discard(tmp: Location) -> None:
    """Remove an unpublished temporary directory.

    What cannot be removed now, a later :func:`clean_leftovers` removes.
    """
    if isinstance(tmp, UrlPath):
        try:
            _remove_url_directory(tmp)
        except OSError:
            pass  # a numbered directory without a manifest: clean_leftovers removes it
        return
    shutil.rmtree(tmp, ignore_errors=True)


def replace_symlink(link: Path, target: str) -> None:
    """Point ``link`` at ``target`` atomically (``target`` is stored as given, e.g. relative).

    Args:
        link: The symlink to create or replace.
        target: What it points to; a bare name resolves beside the link.
    """
    tmp = _hidden_name(link, "tmp")
    os.symlink(target, tmp)
    try:
        os.replace(tmp, link)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync(link.parent)


def remove_directory(path: Location, background: Logger | None = None) -> None:
    """Delete a directory so that it disappears from its name at once, even if a crash interrupts.

    Args:
        path: The directory.
        background: Only move it aside here, and delete its contents on a helper thread
            (pruning an old checkpoint need not hold up training), which warns on this logger
            if that fails. :func:`wait_for_removals` waits for those deletions, and
            :func:`clean_leftovers` does before it looks.

    On object storage its manifest is removed at once (it stops counting), the rest after.

    Raises:
        OSError: It could not be moved aside, or (in the foreground) deleted; what remains
            hidden is retried by :func:`clean_leftovers`.
    """
    hidden: Location
    if isinstance(path, UrlPath):
        remove(path / MANIFEST)
        hidden = path
    else:
        hidden = _hidden_name(path, "del")
        os.rename(path, hidden)
    if background is None:
        _remove(hidden)
        return
    global _remover
    if _remover is None:
        _remover = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainloop-prune")
    _removals.append(_remover.submit(_remove_logging, hidden, path, background))


def _remove_logging(hidden: Location, path: Location, logger: Logger) -> None:
    try:
        _remove(hidden)
    except OSError as error:
        logger.warning("Could not remove old checkpoint %s: %s", path, error)


_remover: ThreadPoolExecutor | None = None
_removals: list[Future[None]] = []


def wait_for_removals() -> None:
    """Wait until the directories :func:`remove_directory` deletes in the background are gone.

    Also lets its helper thread end.
    """
    global _remover
    while _removals:
        _removals.pop(0).result()
    if _remover is not None:
        _remover.shutdown()
        _remover = None


def clean_leftovers(parent: Location, logger: Logger) -> None:
    """Settle what interrupted writes left in ``parent`` (see the module docstring).

    Failures are logged, not raised: a leftover that cannot be removed now is retried next time.

    Args:
        parent: The directory holding the atomically written entries.
        logger: Where failures and restorations are reported.
    """
    wait_for_removals()  # a deletion still under way is not a leftover
    if isinstance(parent, UrlPath):
        _clean_url_leftovers(parent, logger)
        return
    if not parent.is_dir():
        return
    for entry in parent.iterdir():
        match = _HIDDEN.fullmatch(entry.name)
        if match is None or not _saved_name(match["name"]):
            continue
        original = entry.with_name(match["name"])
        try:
            if match["kind"] == "old" and not (original.exists() or original.is_symlink()):
                os.rename(entry, original)
                logger.warning("Restored %s, which an interrupted save had moved aside", original)
            else:
                _remove(entry)
        except OSError as error:
            logger.warning("Could not clean up %s: %s", entry, error)


def _clean_url_leftovers(parent: UrlPath, logger: Logger) -> None:
    """Remove the step-named directories under ``parent`` that hold no manifest (see the module docstring)."""
    listed = files(parent)
    complete = {rel.split("/", 1)[0] for rel in listed if rel.count("/") == 1 and rel.endswith(f"/{MANIFEST}")}
    for name in sorted({rel.split("/", 1)[0] for rel in listed if "/" in rel} - complete):
        if not is_step_name(name):
            continue
        try:
            remove(parent / name)
            logger.warning(
                "Removed %s: a save or a removal that did not finish (it had no %s)", parent / name, MANIFEST
            )
        except OSError as error:
            logger.warning("Could not clean up %s: %s", parent / name, error)

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
