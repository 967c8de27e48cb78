"""trainloop report: one self-contained page about a run, checked in a real browser."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helper_hooks import SignalAtStep
from tiny_trainer import TinyTrainer

from trainloop import CheckpointingHook, LoggingHook, ValidationHook
from trainloop.report import build_report

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "trainloop", *args], cwd=cwd, capture_output=True, text=True, env=env, check=False)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """A traced run with metrics, validation and a best checkpoint, then a resumed run ended by a signal."""
    root = tmp_path_factory.mktemp("report") / "run"

    def hooks(*extra):
        return [
            LoggingHook(interval=2),
            ValidationHook(lambda t: {"loss": abs(t.step - 8) / 10, "accuracy": t.step / 20}, interval=4),
            CheckpointingHook(interval=4, keep_best=1, monitor="val/loss", exit_signals=["SIGUSR1"]),
            *extra,
        ]

    TinyTrainer(max_steps=12, hooks=hooks(), workspace=root, trace=True, grad_clip=1.0).train()
    with pytest.raises(SystemExit):
        TinyTrainer(max_steps=20, hooks=hooks(SignalAtStep(15, signal.SIGUSR1)), workspace=root, trace=True,
                    grad_clip=1.0).train()
    return root


def test_the_page_holds_every_section_and_nothing_from_the_network(workspace, tmp_path):
    result = cli("report", str(workspace), "--output", "page.html", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "wrote page.html" in result.stderr
    page = (tmp_path / "page.html").read_text()
    # Self-contained: no scripts, no fetched resources (an SVG namespace is a name, not a fetch).
    assert "<script" not in page
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//|url\(\s*["']?(https?:)?//|@import""", page)
    for heading in ("Metrics", "The machine", "Time per state", "Runs", "Checkpoints", "Settings"):
        assert f">{heading}</h" in page
    for chart in ("loss", "lr/group_0", "val/loss", "val/accuracy", "grad_norm", "step_time"):
        assert f'title="{chart}"' in page
    assert page.count("<svg") >= 8  # the charts and the machine
    assert "SIGUSR1 (exit code 138)" in page
    assert "completed" in page
    # The best checkpoint (val/loss 0 at step 8) is marked; its score and the monitor are shown.
    assert re.search(r'<tr class="best"><td>[^<]*checkpoints/8</td><td class="num">8</td>.*?<td class="num">0</td><td>best</td>', page)
    assert re.search(r"retrying.*?stepping.*?checkpointing", page, re.S)
    assert "&quot;max_steps&quot;: 20" in page  # the resolved settings of the latest run


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz's dot is not installed: the report shows the machine as a table")
def test_the_machine_is_weighted_by_the_trace_and_unused_fail_edges_are_folded(workspace):
    page = build_report(workspace)
    diagram = page[page.index(">The machine<"):page.index(">Time per state<")]
    assert re.search(r"begin_step[^<]* \(n=\d+\)", diagram)
    assert "checkpoint [checkpoint_due] (n=" in diagram
    assert "fail" not in re.sub(r"<p.*?</p>", "", diagram, flags=re.S)  # no run failed: no fail edge drawn


def test_without_graphviz_the_machine_is_a_readable_table(workspace, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no dot here
    page = build_report(workspace)
    assert "Graphviz's <code>dot</code> is not installed" in page
    assert re.search(r"<td>stepping</td><td>checkpointing</td><td>checkpoint</td><td>checkpoint_due</td><td class=\"num\">\d+</td>", page)


def test_a_workspace_without_trace_or_metrics_still_reports(tmp_path):
    TinyTrainer(max_steps=2, workspace=tmp_path / "plain", metrics_file=False).train()
    page = build_report(tmp_path / "plain")
    assert "No trace.jsonl here" in page
    assert "No metrics.jsonl in this workspace" in page
    assert "No checkpoints." in page


def test_not_a_workspace_is_a_clear_error_and_nothing_is_written(tmp_path):
    (tmp_path / "empty").mkdir()
    result = cli("report", "empty", cwd=tmp_path)
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.strip() == "trainloop report: error: empty: no settings.json, so no run was recorded there (a run writes it in its workspace)"
    assert list((tmp_path / "empty").iterdir()) == []


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (.ci/run installs Debian's chromium package)")
def test_the_page_renders_in_a_headless_browser(workspace, tmp_path):
    from PIL import Image

    page = tmp_path / "report.html"
    assert cli("report", str(workspace), "--output", str(page), cwd=tmp_path).returncode == 0
    flags = [
        "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}", "--hide-scrollbars",
    ]
    dom = subprocess.run([CHROMIUM, *flags, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120, check=False)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert dom.stdout.count("<svg") >= 8
    assert "Run report: run" in dom.stdout  # parsed and laid out by the browser
    shot = tmp_path / "shot.png"
    subprocess.run([CHROMIUM, *flags, "--window-size=1280,2400", f"--screenshot={shot}", page.as_uri()],
                   capture_output=True, timeout=120, check=True)
    image = Image.open(shot).convert("RGB")
    assert image.size == (1280, 2400)
    pixels = np.asarray(image).reshape(-1, 3).astype(int)
    # Not blank: text, cards and chart lines are painted over the page's light background (a
    # blank or failed page has no dark pixel at all)...
    assert (pixels.min(axis=1) < 200).sum() > 0.005 * len(pixels)
    # ...and the charts' curves, in matplotlib's first colour (#1f77b4), are among them.
    r, g, b = pixels.T
    assert ((b > 150) & (r < 80) & (g > 90) & (g < 150)).sum() > 500
