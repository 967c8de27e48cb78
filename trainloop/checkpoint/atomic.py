"""Crash-safe writes of directories and files: a reader sees the old one or the complete new one.

Locally, work in progress lives beside its target under a hidden name ``.<name>.<kind>-<hex>``:

- ``tmp``: being written, or a symlink about to replace another; never complete, so removed.
- ``old``: a complete directory moved aside so a new one can take its name; restored when a
  crash left the name empty, else removed.
- ``del``: being deleted; removed.

Object storage (a :class:`~trainloop.checkpoint.storage.UrlPath`) has no rename: a directory is
written in place and counts once its manifest, written last, is there (see
:mod:`trainloop.checkpoint.manifest`); a directory is removed manifest first, so it stops counting
at once; a file is one upload, which the store makes visible whole. There, a leftover is a
numbered directory without a manifest: a save that did not finish, or a removal.

:func:`clean_leftovers` settles what a crash left behind. It assumes a single writer per
parent directory: a second process writing there at the same time could lose its work.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from logging import Logger
from pathlib import Path

from trainloop.checkpoint import storage
from trainloop.checkpoint.manifest import MANIFEST
from trainloop.checkpoint.storage import Location, UrlPath

__all__ = [
    "atomic_directory",
    "atomic_file",
    "clean_leftovers",
    "discard",
    "make_temporary",
    "publish",
    "remove_directory",
    "replace_symlink",
    "wait_for_removals",
]

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
    storage.remove(directory / MANIFEST)
    storage.remove(directory)


@contextmanager
def atomic_directory(target: Location, then: Callable[[], None] | None = None) -> Iterator[Location]:
    """Yield an empty temporary directory to fill; on success it becomes ``target``.

    Every file written into it is fsynced before the directory is renamed into place, so the
    rename publishes complete contents. An existing ``target`` is moved aside first and removed
    after the swap; a crash in between is undone by :func:`clean_leftovers`. On an exception
    the temporary directory is removed and ``target`` keeps its old contents. On object storage
    the directory yielded is ``target`` itself (see :func:`make_temporary`).

    Args:
        target: The directory to create or replace. Its parent is created if needed.
        then: Completes the publication once the directory is in place (e.g. pointing
            ``latest`` at it); see :func:`publish`.
    """
    tmp = make_temporary(target)
    try:
        yield tmp
        publish(tmp, target, then)
    except BaseException:
        discard(tmp)
        raise


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

    For writers that cannot use :func:`atomic_directory` as one block: several processes
    filling one directory, or a write finished on another thread. Hand it to :func:`publish`
    when complete, or to :func:`discard`.

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


def publish(tmp: Location, target: Location, then: Callable[[], None] | None = None) -> None:
    """Fsync everything in ``tmp`` and rename it to ``target`` (replacing an existing one).

    Args:
        tmp: The complete directory, from :func:`make_temporary`.
        target: Its name once published.
        then: Called once ``tmp`` is in place, before the directory it replaced is removed;
            if it raises, the publication is undone (the new directory leaves ``target``, the
            old one comes back) and the error propagates. So a step that must succeed for
            the directory to count, such as updating ``latest``, leaves nothing behind when
            it fails.

    On object storage ``tmp`` is ``target``, which its manifest published already: only
    ``then`` remains (if it fails, the directory is removed).
    """
    if isinstance(tmp, UrlPath):
        if then is not None:
            try:
                then()
            except BaseException:
                _remove_url_directory(tmp)
                raise
        return
    assert isinstance(target, Path)
    for path in tmp.rglob("*"):
        _fsync(path)
    _fsync(tmp)
    _swap_into_place(tmp, target, then)


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


def _swap_into_place(new: Path, target: Path, then: Callable[[], None] | None) -> None:
    # POSIX rename cannot replace a non-empty directory, so the old one steps aside first.
    old = None
    if target.exists() or target.is_symlink():
        old = _hidden_name(target, "old")
        os.rename(target, old)
    try:
        os.rename(new, target)
    except BaseException:
        if old is not None:
            os.rename(old, target)
        raise
    _fsync(target.parent)
    if then is not None:
        try:
            then()
        except BaseException:
            _unpublish(target, old)
            raise
    if old is not None:
        try:
            _remove(old)
        except OSError:
            pass  # the new directory is in place; clean_leftovers retries the old one later


def _unpublish(target: Path, old: Path | None) -> None:
    """Take the just-published ``target`` back out of its name, and put ``old`` back there."""
    gone = _hidden_name(target, "del")
    os.rename(target, gone)
    if old is not None:
        os.rename(old, target)
    _fsync(target.parent)
    shutil.rmtree(gone, ignore_errors=True)  # what stays hidden, clean_leftovers removes


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


def remove_directory(path: Location, background: Callable[[OSError], None] | None = None) -> None:
    """Delete a directory so that it disappears from its name at once, even if a crash interrupts.

    Args:
        path: The directory.
        background: Only move it aside here, and delete its contents on a helper thread
            (pruning an old checkpoint need not hold up training), which calls this with the
            error if that fails. :func:`wait_for_removals` waits for those deletions, and
            :func:`clean_leftovers` does before it looks.

    On object storage its manifest is removed at once (it stops counting), the rest after.

    Raises:
        OSError: It could not be moved aside, or (in the foreground) deleted; what remains
            hidden is retried by :func:`clean_leftovers`.
    """
    hidden: Location
    if isinstance(path, UrlPath):
        storage.remove(path / MANIFEST)
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
    _removals.append(_remover.submit(_remove_reporting, hidden, background))


def _remove_reporting(path: Location, report: Callable[[OSError], None]) -> None:
    try:
        _remove(path)
    except OSError as error:
        report(error)


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
        if match is None:
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
    """Remove the numbered directories under ``parent`` that hold no manifest (see the module docstring)."""
    listed = storage.files(parent)
    complete = {rel.split("/", 1)[0] for rel in listed if rel.count("/") == 1 and rel.endswith(f"/{MANIFEST}")}
    for name in sorted({rel.split("/", 1)[0] for rel in listed if "/" in rel} - complete):
        if not name.isdigit():
            continue
        try:
            storage.remove(parent / name)
            logger.warning(
                "Removed %s: a save or a removal that did not finish (it had no %s)", parent / name, MANIFEST
            )
        except OSError as error:
            logger.warning("Could not clean up %s: %s", parent / name, error)
