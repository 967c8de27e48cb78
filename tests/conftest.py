"""Fixtures shared by the test modules (helper modules live in tests/support/)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest


@pytest.fixture
def isolated_cli(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A clean stage for in-process ``trainloop`` calls: they read ``os.environ`` (no stray
    ``TRAINLOOP_*`` from the outside) and put the working directory (``tmp_path``) on
    ``sys.path``, which is restored afterwards."""
    for key in [k for k in os.environ if k.upper().startswith("TRAINLOOP_")]:
        monkeypatch.delenv(key)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.chdir(tmp_path)
