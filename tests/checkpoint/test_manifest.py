"""trainloop.checkpoint.manifest: the manifest lists every file a checkpoint must hold, even one
the writing process does not see (another rank's shard), so verification refuses it there."""

from __future__ import annotations

import json

import pytest
import xxhash

from trainloop.checkpoint import MANIFEST, CheckpointError, verify_checkpoint
from trainloop.checkpoint.manifest import FileDigest, write_json, write_manifest


def test_the_manifest_lists_known_digests_and_hashes_the_other_files(tmp_path):
    known = {"a.json": write_json({"x": 1}, tmp_path / "a.json")}
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.bin").write_bytes(b"bytes")
    write_manifest(tmp_path, known)
    files = json.loads((tmp_path / MANIFEST).read_text())["files"]
    assert files == {
        "a.json": {"size": known["a.json"].size, "xxh3_128": known["a.json"].hex},
        "sub/b.bin": {"size": 5, "xxh3_128": xxhash.xxh3_128(b"bytes").hexdigest()},
    }
    assert verify_checkpoint(tmp_path).keys() == {"a.json", "sub/b.bin"}


def test_a_known_file_this_process_cannot_see_is_listed_and_fails_verification(tmp_path):
    (tmp_path / "mine.bin").write_bytes(b"mine")
    write_manifest(tmp_path, {"sharded/__1_0.distcp": FileDigest(10, "0" * 64)})
    files = json.loads((tmp_path / MANIFEST).read_text())["files"]
    assert sorted(files) == ["mine.bin", "sharded/__1_0.distcp"]
    with pytest.raises(CheckpointError, match=r"missing sharded/__1_0.distcp \(listed in its manifest\)"):
        verify_checkpoint(tmp_path)
