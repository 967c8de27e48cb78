"""Fixtures shared by the test modules (helper modules live in tests/support/)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

#: The folders whose files take longest (real processes, several ranks), collected first: README's
#: command hands each of two workers a whole file at a time, so the run then ends on short files.
#: predict (two torchrun launches) and report (a browser) would otherwise come last of all.
SLOW_FIRST = ("processes", "distributed", "checkpoint", "docs", "predict", "report")


def pytest_configure(config: pytest.Config) -> None:
    """Keep the order below: since 3.5 pytest-xdist hands out the files with the most tests first
    (3.8 lets a run turn that off), which put the slow files (few tests, each a real process) at
    the end of the run, one worker ending alone on them while the other idled."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def _slowness(item: pytest.Item) -> int:
    parts = Path(str(item.path)).parts
    return next((i for i, folder in enumerate(SLOW_FIRST) if folder in parts), len(SLOW_FIRST))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The slow folders first (a stable sort: each file keeps its order); the tests marked ``cuda``
    skipped where torch sees no CUDA device (CI has none)."""
    items.sort(key=_slowness)
    marked = [item for item in items if item.get_closest_marker("cuda") is not None]
    if not marked:
        return
    import torch  # only when a CUDA test was collected

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in marked:
        item.add_marker(skip)


@pytest.fixture
def isolated_cli(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A clean stage for in-process ``trainloop`` calls: they read ``os.environ`` (no stray
    ``TRAINLOOP_*`` from the outside) and put the working directory (``tmp_path``) on
    ``sys.path``, which is restored afterwards."""
    for key in [k for k in os.environ if k.upper().startswith("TRAINLOOP_")]:
        monkeypatch.delenv(key)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.chdir(tmp_path)
