"""What a checkpoint holds, for people and for checks: ``metadata.json`` and ``manifest.json``.

``metadata.json`` is plain JSON, readable without torch::

    {"step": 1000, "epoch": 3, "time": "2025-01-31T12:00:00+00:00", "format": "full",
     "metrics": {"train/loss": 0.25}, "trainloop_version": "0.1.0", "torch_version": "2.7.0"}

``manifest.json`` is written last, once every other file is complete, and lists each of them
(paths relative to the checkpoint, ``/``-separated) with its size and XXH3-128 checksum (see
:mod:`trainloop.checkpoint.hashing`)::

    {"manifest_version": 2, "files": {"model.pt": {"size": 1234, "xxh3_128": "9f86d0..."}, ...}}

Version 1 manifests, written before, record SHA-256 (``"sha256"``) instead; they are verified
the same way.

A checkpoint without a valid manifest, or whose files differ from it, is incomplete: a save
that did not finish, or a file truncated or corrupted since. On object storage, where a
directory cannot be renamed into place, the manifest is what publishes a checkpoint.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from pathlib import PurePosixPath
from typing import Any

import torch

from trainloop.checkpoint import storage
from trainloop.checkpoint.errors import CheckpointError
from trainloop.checkpoint.hashing import CHECKSUM, CHECKSUMS, FileDigest, HashingWriter, new_hash
from trainloop.checkpoint.storage import Location, location
from trainloop.utils import flatten_nested_dict, to_float
from trainloop.version import __version__

__all__ = [
    "MANIFEST",
    "METADATA",
    "FileDigest",
    "check_hashes",
    "check_listing",
    "hash_file",
    "make_metadata",
    "read_manifest",
    "read_metadata",
    "save_torch",
    "verify_checkpoint",
    "write_json",
    "write_manifest",
]

MANIFEST = "manifest.json"
METADATA = "metadata.json"
MANIFEST_VERSION = 2
_READABLE_VERSIONS = (1, 2)  # 1: SHA-256 entries


def save_torch(obj: Any, path: Location) -> FileDigest:
    """``torch.save(obj, path)``, hashing the bytes on their way to the file.

    See :class:`~trainloop.checkpoint.hashing.HashingWriter`.
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
