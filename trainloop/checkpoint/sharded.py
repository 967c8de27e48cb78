"""The sharded format: ``torch.distributed.checkpoint`` (DCP) for what is big or sharded.

A sharded checkpoint directory holds, besides ``metadata.json`` and ``manifest.json``:

- ``sharded/``: a DCP checkpoint of the model, the optimizer and the hooks' states, laid out
  like ``trainer.state_dict()`` (``{"model", "training_state": {"optimizer"}, <hook>...}``, or
  ``{"optimizers": {<name>: ...}}`` for several optimizers).
  Every rank writes its own shard (``__<rank>_<n>.distcp``); a tensor replicated on every rank
  (DDP) is written once. DCP reshards on load, so it can be read by another number of ranks,
  or by one process without a process group.
- ``training_state.pt``: the rest of ``training_state`` (step, epoch, scheduler, scaler,
  every rank's random and data-loader state, settings JSON), the same on every rank and
  written by rank 0.

Loading is as careful as in the full format: entries are read with ``weights_only=True``, and
DCP's pickled index (``.metadata``) with an unpickler that accepts only DCP's own classes.

On object storage DCP writes through fsspec (its ``FsspecWriter``), each shard hashed as it is
uploaded, and reads through :class:`~trainloop.checkpoint.loading.VerifiedFiles` (each file
downloaded once, verified) or its ``FsspecReader``.
"""

from __future__ import annotations

import io
import os
import pickle
import time
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import (
    Metadata,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from trainloop.checkpoint import storage
from trainloop.checkpoint.errors import CheckpointError
from trainloop.checkpoint.loading import SHARDED_DIR, VerifiedFiles, load_file, refused_or_corrupt
from trainloop.checkpoint.manifest import REST_FILE, FileDigest, HashingWriter
from trainloop.distributed.ranks import in_process_group
from trainloop.location import Location, UrlPath

__all__ = [
    "REST_FILE",
    "SHARDED_DIR",
    "CheckpointException",
    "join_state",
    "load_sharded",
    "own_shards",
    "read_sharded",
    "shard_writer",
    "split_state",
    "unshared_storage",
    "visible",
]


#: The entries of ``training_state`` DCP writes: one optimizer's state, or several by name.
SHARDED_ENTRIES = ("optimizer", "optimizers")


def split_state(state_dict: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split a trainer state dict into what DCP writes and the rest of ``training_state``."""
    rest = dict(state_dict["training_state"])
    sharded = {key: value for key, value in state_dict.items() if key != "training_state"}
    sharded["training_state"] = {key: rest.pop(key) for key in SHARDED_ENTRIES if key in rest}
    return sharded, rest


def join_state(sharded: Mapping[str, Any], rest: Mapping[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`split_state`."""
    state_dict = {key: value for key, value in sharded.items() if key != "training_state"}
    state_dict["training_state"] = {**rest, **sharded.get("training_state", {})}
    return state_dict


class _Hashing:
    """Mixed into a DCP file system: every shard file is hashed as it is written (never read back)."""

    digests: dict[str, FileDigest]

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
        with super().create_stream(path, mode) as stream:  # type: ignore[misc]
            if mode != "wb" or not str(path).endswith(".distcp"):
                yield stream
                return
            hashing = HashingWriter(stream)
            try:
                yield hashing
            finally:
                hashing.close()
        self.digests[f"{SHARDED_DIR}/{PurePosixPath(str(path)).name}"] = hashing.digest()


class _HashingFileSystem(_Hashing, FileSystem):
    """DCP's local file system, hashing the shards."""

    def __init__(self) -> None:
        super().__init__()
        self.digests = {}


def shard_writer(directory: Location) -> FileSystemWriter:
    """A DCP writer of ``directory`` that fsyncs and hashes every file it writes, one file per rank.

    On object storage, DCP's fsspec writer (uploads have nothing to fsync). See :func:`own_shards` for the digests.
    """
    if isinstance(directory, UrlPath):
        from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as FsspecFileSystem
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        class _HashingFsspec(_Hashing, FsspecFileSystem):
            """DCP's fsspec file system, hashing the shards."""

        writer: FileSystemWriter = FsspecWriter(
            str(directory), single_file_per_rank=True, sync_files=False, **directory.fs.storage_options
        )
        hashing: Any = _HashingFsspec()
        hashing.fs, hashing.digests = directory.fs, {}
        writer.fs = hashing
        return writer
    writer = FileSystemWriter(directory, single_file_per_rank=True, sync_files=True)
    writer.fs = _HashingFileSystem()
    return writer


def own_shards(writer: FileSystemWriter) -> dict[str, FileDigest]:
    """Digests of the shard files ``writer`` wrote (this rank's), by path relative to the checkpoint.

    They were hashed while they were written: no rank reads its shards back.
    """
    fs = writer.fs
    return dict(fs.digests) if isinstance(fs, _Hashing) else {}


#: How long a rank waits for a file or directory another rank made to appear (network file
#: systems may show a new name to other machines a moment late).
VISIBLE_WITHIN = 2.0


def visible(path: Location, size: int | None = None, within: float = VISIBLE_WITHIN) -> bool:
    """Whether ``path`` exists (with ``size`` bytes, if given), waiting up to ``within`` seconds.

    A directory on object storage is taken as seen: there, a directory exists only once
    something is written in it, and :func:`unshared_storage` checks what each rank wrote.
    """
    if isinstance(path, UrlPath) and size is None:
        return True
    deadline = time.monotonic() + within
    while True:
        try:
            found: int | None = path.stat().st_size if isinstance(path, Path) else storage.file_size(path)
        except FileNotFoundError:
            found = None
        if found is not None and size in (None, found):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def unshared_storage(target: Location, tmp: Location, gathered: list[tuple[dict[str, FileDigest], bool]]) -> str | None:
    """What rank 0 finds wrong with the other ranks' shards of ``tmp``, or ``None``.

    Args:
        target: The checkpoint being saved.
        tmp: Its directory being written, as rank 0 made it.
        gathered: Per rank, the digests of the shard files it wrote (paths relative to
            ``tmp``) and whether it found rank 0's ``tmp`` before writing.
    """
    blind = [rank for rank, (_, saw) in enumerate(gathered) if not saw]
    if blind:
        return (
            f"could not save checkpoint {target}: rank {', '.join(map(str, blind))} cannot see {tmp}, "
            "the directory rank 0 made for it, and wrote its shards elsewhere. The sharded format "
            "needs the checkpoint path on storage every rank shares, under the same path (a "
            "relative path resolves against each rank's own working directory)"
        )
    for rank, (digests, _) in enumerate(gathered):
        for rel, digest in digests.items():
            if not visible(tmp / rel, digest.size):
                return (
                    f"could not save checkpoint {target}: rank {rank} wrote {rel} ({digest.size} bytes) "
                    f"but rank 0 does not see it complete in {tmp} after {VISIBLE_WITHIN:g} s; the "
                    "sharded format needs storage every rank shares"
                )
    return None


@contextmanager
def quiet_single_process() -> Iterator[None]:
    """Silence DCP's warning that it runs in one process: without a process group, we mean it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def load_sharded(directory: Location, template: dict[str, Any], files: VerifiedFiles | None = None) -> dict[str, Any]:
    """Load a sharded checkpoint into ``template``, a trainer's ``state_dict()`` (all ranks).

    DCP fills the template's tensors in place (each rank reading the pieces of its shards). A
    hook whose state the checkpoint lacks keeps no entry, so the hook sees it missing.

    Args:
        directory: The checkpoint.
        template: What to load into.
        files: Read every file through these (each opened once, verified as it is read, the
            ones verified already read out of memory); unverified reads if ``None``.

    Raises:
        CheckpointError: A file is corrupt or refused, or the checkpoint does not hold what the
            template needs (another model); the message names the checkpoint.
    """
    sharded, _ = split_state(template)
    reader = _SafeReader(directory / SHARDED_DIR, files)
    saved = {path[0] for path in _planner_paths(reader.read_metadata()).values()}
    sharded = {key: value for key, value in sharded.items() if key in saved or key == "model"}
    _dcp_load(directory, sharded, reader, not in_process_group())
    rest = files.load(REST_FILE) if files is not None else load_file(directory / REST_FILE)
    return join_state(sharded, rest)


def read_sharded(directory: Location, files: VerifiedFiles | None = None) -> dict[str, Any]:
    """Read a whole sharded checkpoint into this process, without a template or process group.

    Args:
        directory: The checkpoint.
        files: Read every file through these (verified); unverified reads if ``None``.
    """
    reader = _SafeReader(directory / SHARDED_DIR, files)
    metadata = reader.read_metadata()
    tree: dict[Any, Any] = {}
    for fqn, path in _planner_paths(metadata).items():
        item = metadata.state_dict_metadata[fqn]
        value = torch.empty(item.size, dtype=item.properties.dtype) if isinstance(item, TensorStorageMetadata) else None
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    sharded = _lists_back(tree)
    _dcp_load(directory, sharded, reader, no_dist=True)
    # An optimizer without state (plain SGD) left DCP no tensor to write under "state".
    training_state = sharded.setdefault("training_state", {})
    for optimizer in training_state["optimizers"].values() if "optimizers" in training_state else [
        training_state.setdefault("optimizer", {})
    ]:
        optimizer.setdefault("state", {})
    rest = files.load(REST_FILE) if files is not None else load_file(directory / REST_FILE)
    return join_state(sharded, rest)


def _planner_paths(metadata: Metadata) -> dict[str, tuple[Any, ...]]:
    """Each saved entry's path in the nested state dict (DCP flattens it to dotted names)."""
    planner_data = metadata.planner_data or {}
    return {fqn: tuple(planner_data.get(fqn, (fqn,))) for fqn in metadata.state_dict_metadata}


def _lists_back(node: Any) -> Any:
    """Turn the dicts keyed 0..n-1 (lists DCP flattened) back into lists."""
    if not isinstance(node, dict):
        return node
    items = {key: _lists_back(value) for key, value in node.items()}
    if items and all(isinstance(key, int) for key in items) and sorted(items) == list(range(len(items))):
        return [items[i] for i in range(len(items))]
    return items


def _dcp_load(directory: Location, state_dict: dict[str, Any], reader: FileSystemReader, no_dist: bool) -> None:
    try:
        with quiet_single_process():
            dcp_load(state_dict, storage_reader=reader, planner=_SafeLoadPlanner(), no_dist=no_dist)
    except CheckpointException as error:
        failures = [failure[0] for failure in error.failures.values()]
        first = next((f for f in failures if isinstance(f, CheckpointError)), failures[0] if failures else error)
        if isinstance(first, CheckpointError):
            raise first from None
        raise CheckpointError(f"{directory / SHARDED_DIR}: cannot load: {first}") from None
    except (RuntimeError, ValueError, KeyError) as error:
        if isinstance(error, CheckpointError):
            raise
        raise CheckpointError(f"{directory / SHARDED_DIR}: cannot load: {error}") from error


class _SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's planner, but non-tensor entries are unpickled with ``weights_only=True``."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        name = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as error:
            raise refused_or_corrupt(f"{SHARDED_DIR} entry {name!r}", error) from error
        # The parent unpickles without restriction: hand it the object re-serialised, now
        # known to hold nothing but plain data.
        safe = io.BytesIO()
        torch.save(obj, safe)
        safe.seek(0)
        super().load_bytes(read_item, safe)


# What DCP's index may refer to: its own metadata classes, torch's dtypes and sizes, paths.
_INDEX_GLOBALS = {
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
}


class _Refused(pickle.UnpicklingError):
    """The index names a global outside what a checkpoint index holds."""


class _IndexUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "torch.distributed.checkpoint.metadata" or name in _INDEX_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(
            getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)
        ):
            return getattr(torch, name)
        raise _Refused(f"{module}.{name} is not part of a checkpoint index")


class _VerifiedFileSystem(FileSystem):
    """DCP's file system read through :class:`VerifiedFiles`: each file opened once, verified.

    DCP names the files ``<checkpoint>/sharded/<name>``, as :meth:`concat_path` joins them.
    """

    def __init__(self, files: VerifiedFiles) -> None:
        super().__init__()
        self.files = files

    def init_path(self, path: str | os.PathLike[str], **kwargs: Any) -> str:
        return SHARDED_DIR

    def concat_path(self, path: str | os.PathLike[str], suffix: str) -> str:
        return f"{path}/{suffix}"

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
        if mode != "rb":
            raise ValueError(f"{self.files.directory / str(path)}: a checkpoint being loaded is read only")
        with self.files.open(str(path)) as stream:
            yield stream


class _SafeReader(FileSystemReader):
    """DCP's file reader, unpickling the index only into DCP's own classes.

    Given :class:`VerifiedFiles`, it reads every file through them (and the index once);
    otherwise it reads a local directory, or one on object storage through fsspec.
    """

    def __init__(self, path: Location, files: VerifiedFiles | None = None) -> None:
        super().__init__(path if isinstance(path, os.PathLike) else str(path))
        if files is not None:
            self.fs = _VerifiedFileSystem(files)
            self.path = self.fs.init_path(SHARDED_DIR)
        elif isinstance(path, UrlPath):
            from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as FsspecFileSystem

            fsspec_fs: Any = FsspecFileSystem()
            self.fs = fsspec_fs
            self.path = fsspec_fs.init_path(str(path), **path.fs.storage_options)
        self._where = path
        self._metadata: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        if rank is None and self._metadata is not None:  # DCP asks again: the same index, not read again
            self._metadata.storage_meta.load_id = self.load_id  # type: ignore[union-attr]
            return self._metadata
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        path = self._where / name
        try:
            with self.fs.create_stream(self.fs.concat_path(self.path, name), "rb") as file:
                metadata = _IndexUnpickler(file).load()
        except FileNotFoundError:
            raise CheckpointError(f"{self._where} is not a complete checkpoint: missing {name}") from None
        except CheckpointError:
            raise  # read through VerifiedFiles: missing or corrupt, said so
        except _Refused as error:
            raise CheckpointError(f"{path}: refused to load: unpickling it could run code ({error})") from None
        except Exception as error:
            raise refused_or_corrupt(str(path), error) from error
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path}: not a checkpoint index (a {type(metadata).__name__})")
        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        if rank is None:
            self._metadata = metadata
        return metadata
