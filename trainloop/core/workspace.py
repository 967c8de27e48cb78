"""The workspace: a directory a run can write, held by one run at a time.

- :func:`path_problem` says why a directory cannot be used (a file in the way, a NUL byte, no
  write permission), without creating anything: the preflight asks it of every directory a run
  will write, so that ``validate`` says it too and ``run`` says it before any step.
  :func:`file_problem` says it of a file to write (a directory in the way), and with ``probe``
  tries to create a file there (a read-only or special filesystem that permissions do not show).
  :func:`declared_output_problems` asks either of a path a hook declares, relative ones under the workspace.
- :func:`hold_workspace` holds ``<workspace>/run.lock`` for a run's life (an OS lock, released
  by the kernel when the process ends, however it ends). A second run in the same workspace is
  refused with :class:`WorkspaceBusyError` naming the holder's host and PID; a lock file left by
  a process that is gone is taken over with a message.
- :func:`hold_run_location` holds a run's checkpoint location the same way, for the
  ``CheckpointingHook`` that writes there: one location belongs to one live run. A local
  directory gets its own ``run.lock`` (the same OS lock). Object storage has no lock: there the
  run writes a lease, ``<prefix>/run.lock`` (owner id, host, PID, expiry), renews it on a helper
  thread every :data:`LEASE_SECONDS` / 3 and removes it at the end. A lease past its expiry is
  a run that is gone (killed, its machine down: nothing renews it), and so is one naming a PID of
  this host that no longer runs; either is taken over with a message. Residual race: the store
  offers no compare-and-swap here, so the lease is written and read back after a moment (the
  later writer of two is refused); two runs that start within less than a read of each other
  may both go ahead.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, suppress
from logging import Logger
from pathlib import Path
from typing import Any, TextIO

import torch.distributed as dist

from trainloop.checkpoint import storage
from trainloop.distributed.ranks import in_process_group, rank
from trainloop.hook_machinery.checks import HookProblem, one_process
from trainloop.location import Location, UrlPath

__all__ = [
    "LEASE_SECONDS",
    "LOCK_FILE",
    "WorkspaceBusyError",
    "file_problem",
    "hold_run_location",
    "hold_run_workspace",
    "hold_workspace",
    "declared_output_problems",
    "path_problem",
]

LOCK_FILE = "run.lock"


class WorkspaceBusyError(RuntimeError):
    """Another run holds the workspace; nothing was written (the command line exits with ``exit_code``)."""

    exit_code = 2


def path_problem(path: Path) -> str | None:
    """Why a run could not make and write the directory ``path``, else ``None``.

    Reads the filesystem only: nothing is created.
    """
    text = str(path)
    if "\0" in text:
        return f"{text!r}: a path cannot hold a NUL byte"
    path = path.expanduser()
    existing = path
    while not existing.exists():
        if existing.parent == existing:
            return None
        existing = existing.parent
    if not existing.is_dir():
        if existing == path:
            return f"{text}: is a file, not a directory"
        return f"{text}: {existing} is a file, not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        where = "" if existing == path else f" ({existing})"
        return f"{text}: the directory{where} is not writable"
    return None


def file_problem(path: Path, probe: bool = False) -> str | None:
    """Why a run could not write the file ``path`` (making its directory), else ``None``.

    Args:
        path: The file.
        probe: Also create (and remove at once) a hidden file in the nearest existing directory:
            some filesystems refuse new files whatever the permissions say (read-only mounts,
            ``/proc``). Without it, nothing is created.
    """
    text = str(path)
    if "\0" in text:
        return f"{text!r}: a path cannot hold a NUL byte"
    expanded = path.expanduser()
    if expanded.is_dir():
        return f"{text}: is a directory, not a file"
    problem = path_problem(expanded.parent)
    if problem is not None:
        return f"{text}: {problem}"
    if not probe:
        return None
    existing = expanded.parent
    while not existing.exists():
        existing = existing.parent
    try:
        with tempfile.NamedTemporaryFile(dir=existing, prefix=f".{expanded.name}.probe-"):
            pass
    except OSError as error:
        return f"{text}: cannot create a file in {existing}: {error.strerror or error}"
    return None


def declared_output_problems(settings: Any, path: Path, name: str, kind: str = "directory") -> list[HookProblem]:
    """A problem if the run could not write ``path`` (a ``"directory"`` or a ``"file"``), read from the filesystem.

    A relative ``path`` is under the workspace (none set: ``needs_workspace`` says it). Nothing
    is created; under a launcher nothing is read (see ``trainloop.hook_machinery.checks.one_process``).

    Args:
        settings: The run's ``TrainerSettings``.
        path: The declared path.
        name: The parameter holding it.
        kind: What the hook writes there.
    """
    full = Path(path).expanduser()
    if not full.is_absolute():
        if settings.workspace is None:
            return []
        full = settings.workspace / full
    if not one_process():
        return []
    problem = path_problem(full) if kind == "directory" else file_problem(full)
    return [] if problem is None else [(name, problem)]


@contextmanager
def hold_workspace(
    workspace: Path | None, logger: Logger, instead: str = "another workspace", remove: bool = False
) -> Iterator[None]:
    """Hold ``workspace`` for the duration of the block (nothing to hold without one).

    Args:
        workspace: The directory.
        logger: Where a takeover is said.
        instead: What the refusal tells the user to give instead.
        remove: Remove the lock file when released (a checkpoint location keeps no trace of it);
            a run that locked a file removed meanwhile locks the new one instead.

    Raises:
        WorkspaceBusyError: Another live process holds it; this one wrote nothing.
    """
    if workspace is None:
        yield
        return
    made = not workspace.exists()
    workspace.mkdir(parents=True, exist_ok=True)
    path = workspace / LOCK_FILE
    with _locked(path, f"{workspace}: in use by {{}}; wait for it to end or give {instead}") as file:
        file.seek(0)
        left = file.read().strip()
        if left:  # its holder ended without releasing it: killed, or its machine went down
            logger.warning("Taking over %s from %s, which is gone", path, _describe(left))
        file.seek(0)
        file.truncate()
        file.write(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}) + "\n")
        file.flush()
        try:
            yield
        finally:
            # A directory this run made and left holding nothing (a run refused before writing) goes too.
            if remove or (made and _holds_nothing(workspace)):
                with suppress(OSError):  # a directory made read-only meanwhile keeps an empty lock file, a free one
                    path.unlink(missing_ok=True)  # still locked: whoever opened it meanwhile retries
                if made and _holds_nothing(workspace):
                    _remove_empty(workspace)
            file.seek(0)
            file.truncate()  # released: an empty lock file is a free workspace
            file.flush()


def _holds_nothing(directory: Path) -> bool:
    """Whether ``directory`` holds no file but its lock (empty folders aside)."""
    return all(p.is_dir() or p.name == LOCK_FILE for p in directory.rglob("*"))


def _remove_empty(directory: Path) -> None:
    """Remove ``directory`` and the empty folders in it, innermost first (what cannot go stays)."""
    for folder in sorted((p for p in directory.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        with suppress(OSError):
            folder.rmdir()
    with suppress(OSError):
        directory.rmdir()


@contextmanager
def _locked(path: Path, busy: str) -> Iterator[TextIO]:
    """``path`` opened and under an exclusive ``flock`` for the block (``busy``, naming the holder, if held)."""
    while True:
        # Bytes that are not UTF-8 (a damaged lock file) are garbage to take over like any other.
        file = path.open("a+", encoding="utf-8", errors="replace")
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            file.close()
            raise WorkspaceBusyError(busy.format(_holder(path))) from None
        try:
            same = os.stat(path).st_ino == os.fstat(file.fileno()).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        file.close()  # removed by its holder as we opened it: lock the file now there
    try:
        yield file
    finally:
        fcntl.flock(file, fcntl.LOCK_UN)
        file.close()


@contextmanager
def hold_run_workspace(workspace: Path | None, logger: Logger) -> Iterator[None]:
    """:func:`hold_workspace` for a run of one or more ranks: rank 0 holds it for all.

    Under a process group every rank learns rank 0's answer, so a refused run ends on every
    rank at once; under a launcher before the group exists, only the process whose ``RANK`` is
    0 takes the lock (the other ranks of a refused run end with it, as a launcher ends them).

    Raises:
        WorkspaceBusyError: Another run holds the workspace; nothing was written.
    """
    if workspace is None:
        yield
        return
    with _on_rank_zero(lambda: hold_workspace(workspace, logger)):
        yield


@contextmanager
def hold_run_location(where: Location, logger: Logger) -> Iterator[None]:
    """Hold a run's checkpoint location (a directory or a URL prefix) for the block; rank 0 holds it for all.

    Raises:
        WorkspaceBusyError: Another live run holds it; nothing was written there.
    """
    instead = "another CheckpointingHook path: one checkpoint location belongs to one run"
    if isinstance(where, Path):
        with _on_rank_zero(lambda: hold_workspace(where, logger, instead, remove=True)):
            yield
        return
    with _on_rank_zero(lambda: _hold_lease(where, logger, instead)):
        yield


#: How long an object-storage lease lasts unless renewed (renewed every third of it).
LEASE_SECONDS = 60.0
#: How long a new lease settles before it is read back (see the module docstring's race).
_SETTLE_SECONDS = 0.5


class _Lease:
    """The lease ``<prefix>/run.lock`` of one run on object storage (see the module docstring)."""

    def __init__(self, prefix: UrlPath) -> None:
        self.prefix, self.path = prefix, prefix / LOCK_FILE
        self.me = {"owner": uuid.uuid4().hex, "host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}
        self.stop = threading.Event()

    def holder(self) -> dict[str, Any] | None:
        """The lease there, ``None`` if none; a damaged one is nobody's (``{}``)."""
        try:
            lease = json.loads(storage.read_bytes(self.path))
        except FileNotFoundError:
            return None
        except ValueError:
            return {}
        return lease if isinstance(lease, dict) else {}

    def write(self) -> None:
        lease = {**self.me, "expires": time.time() + LEASE_SECONDS}
        storage.write_bytes(self.path, (json.dumps(lease) + "\n").encode())

    def ours(self, lease: dict[str, Any] | None) -> bool:
        return lease is not None and lease.get("owner") == self.me["owner"]

    def renew(self, logger: Logger) -> None:
        while not self.stop.wait(LEASE_SECONDS / 3):
            try:
                self.write()
            except OSError as error:
                logger.warning("Could not renew the lease %s: %s", self.path, error)


@contextmanager
def _hold_lease(prefix: UrlPath, logger: Logger, instead: str) -> Iterator[None]:
    """Hold the lease ``<prefix>/run.lock`` on object storage for the block (see the module docstring)."""
    lease = _Lease(prefix)

    def refusal(found: dict[str, Any]) -> WorkspaceBusyError:
        holder = _describe(json.dumps(found))
        return WorkspaceBusyError(f"{prefix}: in use by {holder}; wait for it to end or give {instead}")

    found = lease.holder()
    if found and not lease.ours(found):
        dead = _dead_here(found)
        if not dead and float(found.get("expires", 0)) > time.time():
            raise refusal(found)
        why = "its process is gone" if dead else "its lease expired"
        logger.warning("Taking over %s from %s (%s)", lease.path, _describe(json.dumps(found)), why)
    lease.write()
    time.sleep(_SETTLE_SECONDS)
    found = lease.holder()
    if not lease.ours(found):
        raise refusal(found or {})
    renewer = threading.Thread(target=lease.renew, args=(logger,), name="checkpoint-lease", daemon=True)
    renewer.start()
    try:
        yield
    finally:
        lease.stop.set()
        renewer.join()
        with suppress(OSError):
            if lease.ours(lease.holder()):
                storage.remove(lease.path)


def _dead_here(lease: dict[str, Any]) -> bool:
    """Whether ``lease`` names a process of this host that no longer runs (a run killed here)."""
    if lease.get("host") != socket.gethostname() or not isinstance(lease.get("pid"), int):
        return False
    try:
        os.kill(lease["pid"], 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


@contextmanager
def _on_rank_zero(hold: Callable[[], AbstractContextManager[None]]) -> Iterator[None]:
    """Enter ``hold()`` on rank 0 only; every rank learns whether it was refused."""
    grouped = in_process_group()
    lead = rank() == 0 if grouped else os.environ.get("RANK", "0") == "0"
    with ExitStack() as stack:
        refused: str | None = None
        if lead:
            try:
                stack.enter_context(hold())
            except WorkspaceBusyError as error:
                refused = str(error)
        if grouped:
            box = [refused]
            dist.broadcast_object_list(box, src=0)
            refused = box[0]
        if refused is not None:
            raise WorkspaceBusyError(refused)
        yield


def _holder(path: Path) -> str:
    try:
        return _describe(path.read_text(encoding="utf-8", errors="replace").strip())
    except OSError:
        return "another run"


def _describe(text: str) -> str:
    try:
        holder = json.loads(text)
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(holder["since"])))
        return f"the run of PID {int(holder['pid'])} on host {holder['host']} (since {since})"
    except (ValueError, KeyError, TypeError):
        return "another run"
