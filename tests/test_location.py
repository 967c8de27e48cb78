"""trainloop.location: a path or a URL named without I/O; a URL's filesystem and its options."""

import importlib.util
from pathlib import Path

import fsspec
import pytest

from trainloop.location import StorageError, UrlPath, is_url, location, lost_slash


def test_is_url_and_lost_slash_tell_a_url_from_a_path():
    assert is_url("s3://bucket/run")
    assert is_url("simplecache::s3://bucket/run")
    assert not is_url("runs/exp1")
    assert not is_url(Path("s3://bucket"))  # a Path is never a URL: it lost a '/'
    assert lost_slash(Path("s3://bucket/run")) is not None
    assert lost_slash(Path("runs/s3/run")) is None


def test_a_url_is_a_url_and_a_local_path_stays_local(tmp_path):
    where = location("memory://a/b")
    assert isinstance(where, UrlPath)
    assert str(where / "5") == "memory://a/b/5"
    assert (where / "5").name == "5"
    assert location("file:///tmp/x") == Path("/tmp/x")  # file:// is the local fast path
    assert location("checkpoints") == Path("checkpoints")
    for mangled in ("s3:/bucket/run", Path("s3://bucket/run")):  # what Path() makes of a URL
        with pytest.raises(StorageError, match="a URL scheme without its '//'"):
            location(mangled)
    with pytest.raises(StorageError, match="Protocol not known: nosuch"):
        location("nosuch://x")


def test_storage_options_go_to_the_filesystem_as_given_over_fsspec_config(monkeypatch):
    pytest.importorskip("s3fs")
    monkeypatch.setitem(fsspec.config.conf, "s3", {"endpoint_url": "http://configured:9000", "anon": True})
    configured = location("s3://bucket/run")
    assert configured.fs.storage_options == {"endpoint_url": "http://configured:9000", "anon": True}
    declared = location("s3://bucket/run", {"endpoint_url": "http://declared:9000"})
    assert declared.fs.storage_options == {"endpoint_url": "http://declared:9000", "anon": True}
    assert declared.path == "bucket/run"


@pytest.mark.skipif(importlib.util.find_spec("gcsfs") is not None, reason="gcsfs is installed here")
def test_a_url_whose_filesystem_is_missing_names_the_extra():
    with pytest.raises(StorageError, match=r"gs://bucket/run: the gs:// filesystem is not installed: pip install 'trainloop\[gcs\]'"):
        location("gs://bucket/run")
