"""trainloop.checkpoint.manifest and loading: a full checkpoint's file is checked in the read that loads it.

Every byte is read from the file once (the process's own read counter says so), the checksum is the
whole file's, and a damaged byte anywhere (in the tensors, read in order, or in the zip's directory at
the end, read first) is reported as corruption, not as whatever torch makes of it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import xxhash

from trainloop.checkpoint import CheckpointError
from trainloop.checkpoint.loading import load_verified
from trainloop.checkpoint.manifest import FileDigest, HashingReader

STATES = {
    "one large tensor": {"w": torch.arange(300_000, dtype=torch.float32)},
    "many tensors, nested": {f"layer{i}": {"w": torch.randn(64, 64), "b": torch.randn(64), "n": i} for i in range(40)},
    "a small file": {"x": torch.ones(3)},
    "no tensor": {"step": 7, "note": "text"},
    "views of one storage": (lambda t: {"a": t[:1000], "b": t[500:]})(torch.randn(100_000)),
}


def saved(tmp_path: Path, state) -> tuple[Path, FileDigest]:
    path = tmp_path / "state.pt"
    torch.save(state, path)
    data = path.read_bytes()
    return path, FileDigest(len(data), xxhash.xxh3_128(data).hexdigest())


def bytes_read() -> int:
    """What this process has read through system calls so far (``rchar``)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


@pytest.mark.parametrize("name", STATES)
def test_the_checksum_is_the_whole_files_and_the_load_is_torchs(tmp_path, name):
    path, digest = saved(tmp_path, STATES[name])
    with open(path, "rb", buffering=0) as file:
        reader = HashingReader(file, "xxh3_128")
        loaded = torch.load(reader, map_location="cpu", weights_only=True)
        assert reader.finish() == digest
    expected = torch.load(path, weights_only=True)
    assert str(loaded) == str(expected)
    assert str(load_verified(path, digest)) == str(expected)


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="needs Linux's /proc/self/io to count bytes read")
def test_a_verified_load_reads_each_byte_of_the_file_once(tmp_path):
    path, digest = saved(tmp_path, STATES["many tensors, nested"] | STATES["one large tensor"])
    load_verified(path, digest)  # imports and caches warmed up
    before = bytes_read()
    load_verified(path, digest)
    read = bytes_read() - before
    assert digest.size <= read < digest.size + 64 * 1024, (read, digest.size)


@pytest.mark.parametrize("where", ["tensor data", "zip directory"])
def test_a_flipped_byte_anywhere_is_reported_as_corruption(tmp_path, where):
    path, digest = saved(tmp_path, STATES["one large tensor"])
    data = bytearray(path.read_bytes())
    offset = len(data) // 2 if where == "tensor data" else len(data) - 30  # inside the end-of-directory record
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"state\.pt: cannot load: corrupt \(its XXH3-128 checksum differs"):
        load_verified(path, digest)


def test_a_file_of_another_size_is_refused_before_it_is_read(tmp_path):
    path, digest = saved(tmp_path, STATES["one large tensor"])
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match=rf"cannot load: truncated or altered \({digest.size - 10} bytes"):
        load_verified(path, digest)
