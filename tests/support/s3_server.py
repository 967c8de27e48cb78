"""A local S3 server for the object-storage tests: moto's server mode on 127.0.0.1, in a thread of the test process.

A real HTTP S3 endpoint (moto's ``ThreadedMotoServer``), reached by s3fs exactly as a cloud bucket is,
from this process (``S3.options``) and from child processes (``S3.env``: fsspec's own configuration
variables, so a ``trainloop`` command needs no flags).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("s3fs", reason="the object-storage tests need trainloop[s3] (s3fs), in the dev extra")
moto_server = pytest.importorskip("moto.server", reason="the object-storage tests need moto[s3] and flask, in the dev extra")

import s3fs  # noqa: E402  # after the skip above

_KEY, _SECRET = "testing", "testing"


class S3:
    """The running server: its endpoint, the options to reach it, and fresh buckets."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint

    @property
    def options(self) -> dict[str, Any]:
        """``storage_options`` that reach the server (what a settings file declares)."""
        return {"endpoint_url": self.endpoint, "key": _KEY, "secret": _SECRET}

    def env(self) -> dict[str, str]:
        """fsspec's configuration variables that reach the server, for a child process."""
        return {"FSSPEC_S3_ENDPOINT_URL": self.endpoint, "FSSPEC_S3_KEY": _KEY, "FSSPEC_S3_SECRET": _SECRET}

    def fs(self) -> Any:
        """An s3fs filesystem on the server, listings never cached (other processes write too)."""
        return s3fs.S3FileSystem(**self.options, use_listings_cache=False)

    def bucket(self) -> str:
        """A new, empty bucket's URL (``s3://<name>``)."""
        name = f"test-{uuid.uuid4().hex[:12]}"
        self.fs().mkdir(name)
        return f"s3://{name}"

    def keys(self, url: str) -> list[str]:
        """Every object under ``url``, relative to it, sorted."""
        prefix = url.removeprefix("s3://").rstrip("/") + "/"
        fs = self.fs()
        return sorted(path[len(prefix):] for path in fs.find(prefix))


@pytest.fixture(scope="session")
def s3() -> Iterator[S3]:
    """A local S3 server for the whole session (buckets keep tests apart)."""
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # not a line per request
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield S3(f"http://{host}:{port}")
    finally:
        server.stop()
