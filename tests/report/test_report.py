"""trainloop report: one self-contained page about a run, checked in a real browser."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from browser import CHROMIUM, measure_text, overlapping, run
from cli_process import Cli, cli_env
from helper_hooks import SignalAtStep
from tiny_trainer import TinyTrainer

import trainloop
from trainloop import ValidationHook
from trainloop.report import build_report
from trainloop.settings import TrainerSettings

ROOT = Path(__file__).resolve().parents[2]
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="chromium is not installed (.ci/run installs Debian's chromium package)"
)


def cli(*args: str, cwd: Path, path: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    if path is not None:
        env["PATH"] = path
    return subprocess.run([sys.executable, "-m", "trainloop", *args], cwd=cwd, capture_output=True, text=True, env=env,
                          check=False)


def _settings(root: Path, max_steps: int) -> TrainerSettings:
    """Settings that declare a logging and a checkpointing hook (so the page can show their schedules)."""
    return TrainerSettings(
        max_steps=max_steps, workspace=root, trace=True, grad_clip=1.0,
        hooks=[{"type": "logging", "interval": 1},
               {"type": "checkpointing", "interval": 4, "keep_best": 1, "monitor": "val/loss",
                "exit_signals": ["SIGUSR1"]}],
    )


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """A traced run with metrics, validation and a best checkpoint, then a resumed run ended by a signal."""
    root = tmp_path_factory.mktemp("report") / "run"

    def validation():
        return ValidationHook(lambda t: {"loss": abs(t.step - 8) / 10, "accuracy": t.step / 20}, interval=4)

    TinyTrainer(_settings(root, 12), hooks=[validation()]).train()
    with pytest.raises(SystemExit):
        TinyTrainer(_settings(root, 20), hooks=[validation(), SignalAtStep(15, signal.SIGUSR1)]).train()
    return root


def _card(page: str, title: str) -> str:
    """The chart card titled ``title``."""
    found = re.search(rf'<div class="card" title="{re.escape(title)}">(.*?)</svg>\s*</div>', page, re.S)
    assert found is not None, f"no chart {title!r}"
    return found.group(1)


def _facts(page: str) -> dict[str, str]:
    return dict(re.findall(r'<div class="card fact"><span class="muted">([^<]*)</span><b>([^<]*)</b>', page))


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
    titles = re.findall(r'<div class="card" title="([^"]+)">', page)
    assert titles == ["loss", "accuracy", "grad_norm", "lr", "mse", "time per step (s)"]  # one per family, distinct
    assert "SIGUSR1 (exit code 138)" in page
    assert "completed" in page
    # The best checkpoint (val/loss 0 at step 8) is marked; its score and the monitor are shown.
    assert re.search(r'<tr class="best"><td>[^<]*checkpoints/8</td><td class="num">8</td>.*?<td class="num">0</td><td>best</td>', page)
    assert re.search(r"retrying.*?stepping.*?checkpointing", page, re.S)
    assert "&quot;max_steps&quot;: 20" in page  # the resolved settings of the latest run


def test_train_and_validation_share_a_chart_and_the_best_checkpoint_is_marked_there(workspace):
    page = build_report(workspace)
    loss = _card(page, "loss")
    # svg.fonttype "none": the legend is text in the SVG.
    assert re.search(r">loss</text>", loss)
    assert re.search(r">val/loss</text>", loss)
    assert "best checkpoint (8)" in loss
    assert ">val/accuracy</text>" in _card(page, "accuracy")
    assert "best checkpoint" not in _card(page, "accuracy")
    time = _card(page, "time per step (s)")
    assert ">step_time</text>" in time
    assert ">data_time</text>" in time


def test_smoothing_keeps_the_raw_series_faint_and_can_be_turned_off(workspace, tmp_path):
    faint = "stroke-opacity: 0.25"
    smoothed = build_report(workspace, smoothing=0.9)
    assert faint in _card(smoothed, "loss")  # 15 logged losses: smoothed, the raw values faint behind
    assert faint not in _card(smoothed, "accuracy")  # 5 validations: too few to smooth
    assert faint not in _card(smoothed, "lr")  # a schedule, not noise
    assert "factor 0.9" in smoothed
    result = cli("report", str(workspace), "--output", "raw.html", "--smoothing", "0", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    raw = (tmp_path / "raw.html").read_text()
    assert faint not in raw
    assert "Curves not smoothed" in raw
    # The default is smoothed, the same factor as the API's.
    from trainloop.report.page import DEFAULT_SMOOTHING

    assert f"factor {DEFAULT_SMOOTHING:g}" in build_report(workspace)
    assert cli("report", str(workspace), "--output", "default.html", cwd=tmp_path).returncode == 0
    assert f"factor {DEFAULT_SMOOTHING:g}" in (tmp_path / "default.html").read_text()


@pytest.mark.parametrize("value", ["1", "-0.1", "lots"])
def test_a_smoothing_outside_zero_to_one_is_one_line_and_nothing_is_written(workspace, tmp_path, value):
    result = cli("report", str(workspace), "--output", "page.html", "--smoothing", value, cwd=tmp_path)
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()[-1:]
    assert "argument --smoothing" in line
    assert value in line
    assert "[0, 1)" in line
    assert not (tmp_path / "page.html").exists()


def test_smooth_is_tensorboards_debiased_moving_average():
    from trainloop.report.charts import smooth

    assert smooth([3.0, 3.0, 3.0], 0.9) == pytest.approx([3.0, 3.0, 3.0])  # debiased: no pull towards 0
    assert smooth([1.0, 2.0], 0.5) == pytest.approx([1.0, (0.25 * 1 + 0.5 * 2) / 0.75])
    assert smooth([1.0, float("nan"), 3.0], 0.0)[2] == 3.0
    assert smooth([1.0, float("inf"), 1.0], 0.5)[2] == pytest.approx(1.0)  # a non-finite value stays out


def test_the_run_facts_are_shown(workspace):
    facts = _facts(build_report(workspace))
    assert facts["device"] == "cpu"
    assert facts["torch"] == torch.__version__
    assert facts["trainloop"] == trainloop.__version__
    assert facts["runs"] == "2"
    runs = [json.loads(line) for line in (workspace / "runs.jsonl").read_text().splitlines()]
    total = sum(run["time"] - run["started"] for run in runs)
    assert re.fullmatch(r"[\d.]+ s", facts["duration (runs.jsonl)"])
    assert float(facts["duration (runs.jsonl)"].removesuffix(" s")) == pytest.approx(total, rel=0.01)
    # No throughput logged: steps per second from the logged step times.
    metrics = [json.loads(line) for line in (workspace / "metrics.jsonl").read_text().splitlines()]
    times = sorted(r["step_time"] for r in metrics if "step_time" in r)
    assert float(facts["steps/s (1 / median step_time)"]) == pytest.approx(1 / float(np.median(times)), rel=1e-3)


def test_throughput_and_runs_by_kind_are_read_generically(workspace, tmp_path):
    copy = tmp_path / "ws"
    shutil.copytree(workspace, copy)
    with (copy / "metrics.jsonl").open("a") as file:
        file.write(json.dumps({"step": 20, "time": 1.0, "throughput/items_per_s": 1234.5}) + "\n")
    with (copy / "runs.jsonl").open("a") as file:
        file.write(json.dumps({"time": 2e9, "step": 20, "epoch": 2, "exit_code": 0, "error": None, "kind": "evaluate"}) + "\n")
    page = build_report(copy)
    facts = _facts(page)
    assert facts["throughput/items_per_s (last)"] == "1234"
    assert not any(k.startswith("steps/s") for k in facts)
    assert facts["runs"] == "3 (1 evaluate, 2 train)"
    assert "<td>evaluate</td>" in page


def test_an_old_workspace_without_kinds_versions_or_start_times_still_reports(workspace, tmp_path):
    copy = tmp_path / "old"
    shutil.copytree(workspace, copy)
    keep = ("time", "step", "epoch", "exit_code", "error", "best_checkpoint")
    runs = [json.loads(line) for line in (copy / "runs.jsonl").read_text().splitlines()]
    (copy / "runs.jsonl").write_text("".join(json.dumps({k: r[k] for k in keep}) + "\n" for r in runs))
    page = build_report(copy)
    facts = _facts(page)
    assert facts["device, torch, trainloop"] == "not recorded"
    assert facts["runs"] == "2"
    assert "duration (trace)" in facts  # the trace still knows how long the runs took
    assert page.count("<td>train</td>") == 2  # a line without a kind is a training run
    (copy / "trace.jsonl").unlink()
    assert "duration (≥, first to last metrics)" in _facts(build_report(copy))


def test_the_machine_is_weighted_by_the_trace_with_the_hooks_beside_their_state(workspace):
    page = build_report(workspace)
    diagram = page[page.index(">The machine<"):page.index(">Time per state<")]
    assert '<svg xmlns="http://www.w3.org/2000/svg" class="trainloop-machine"' in diagram
    assert re.search(r"begin_step / begin_step\(\) \(n=\d+\)", diagram)
    assert "checkpoint [checkpoint_due] (n=" in diagram
    assert 'class="edge" data-edge="stepping-&gt;exiting:fail"' not in diagram  # no run failed: folded
    assert 'class="edge folded" data-edge="stepping-&gt;exiting:fail"' in diagram

    def notes(state: str) -> str:
        found = re.search(rf'<g class="notes" data-state="{state}">(.*?)</g>', diagram, re.S)
        assert found is not None, state
        return " ".join(re.findall(r">([^<]*)</text>", found.group(1)))  # wrapped to fit the page

    assert "checkpointing — CheckpointingHook, in checkpointing, every 4 steps and at the end" in notes("checkpointing")
    assert "logging — LoggingHook, after stepping, every step" in notes("stepping")
    # Each state shows its share of the traced time.
    assert re.search(r'data-state="accumulating">.*?\d+%</text>', diagram, re.S)


def test_without_graphviz_the_machine_is_drawn_and_asking_for_graphviz_is_a_clear_error(workspace, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()  # a PATH without dot
    result = cli("report", str(workspace), "--output", "page.html", cwd=tmp_path, path=str(bin_dir))
    assert result.returncode == 0, result.stderr
    assert 'class="trainloop-machine"' in (tmp_path / "page.html").read_text()
    result = cli("report", str(workspace), "--output", "dot.html", "--graphviz", cwd=tmp_path, path=str(bin_dir))
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "trainloop report: error: Graphviz's `dot` program is not on PATH: install Graphviz (`apt-get install "
        "graphviz`, `conda install graphviz` or `brew install graphviz`)"
    )
    assert not (tmp_path / "dot.html").exists()


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz's dot is not installed")
def test_graphviz_stays_an_option(workspace):
    diagram = build_report(workspace, graphviz=True)
    assert "trainloop-machine" not in diagram
    assert re.search(r"<title>stepping&#45;&gt;checkpointing</title>", diagram)


def test_a_workspace_without_trace_or_metrics_still_reports(tmp_path):
    TinyTrainer(max_steps=2, workspace=tmp_path / "plain", metrics_file=False).train()
    page = build_report(tmp_path / "plain")
    assert "No trace.jsonl here" in page
    assert "No metrics.jsonl in this workspace" in page
    assert "No checkpoints." in page
    assert 'class="trainloop-machine"' in page


def test_not_a_workspace_is_a_clear_error_and_nothing_is_written(tmp_path):
    (tmp_path / "empty").mkdir()
    result = cli("report", "empty", cwd=tmp_path)
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.strip() == (
        "trainloop report: error: empty: no settings.json or runs.jsonl, so no run was recorded there (a run writes "
        "them in its workspace)"
    )
    assert list((tmp_path / "empty").iterdir()) == []


def test_a_run_that_crashed_while_building_is_reported_from_runs_jsonl(tmp_path):
    (tmp_path / "run.json").write_text(json.dumps({"max_steps": 3, "workspace": "ws"}))
    crashed = Cli("run", "run.json", "--trainer", "cli_trainers:BuildCrashTrainer", cwd=tmp_path, env=cli_env()).result()
    assert crashed.returncode == 1
    assert "RuntimeError: no memory left for the model" in crashed.stderr
    assert not (tmp_path / "ws" / "settings.json").exists()  # written once the run is built
    result = Cli("report", "ws", cwd=tmp_path, env=cli_env()).result()
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == [f"trainloop report: wrote {Path('ws') / 'report.html'}"]
    page = (tmp_path / "ws" / "report.html").read_text()
    assert "RuntimeError: no memory left for the model" in page  # the run's line in runs.jsonl
    assert "No settings.json: no run got past building" in page


@needs_chromium
def test_the_machine_is_readable_at_page_width_in_a_browser(workspace, tmp_path):
    labels = measure_text(build_report(workspace), "svg.trainloop-machine text", tmp_path, width=1000)
    assert len(labels) > 25  # states, their times, edge labels, notes, the folded fail edges
    # Saves follow the validations at steps 4, 8 and 12 (validating -> checkpointing); the signal's from stepping.
    shown = {label["text"] for label in labels}
    assert shown >= {"stepping", "validating", "checkpointing", "checkpoint [checkpoint_due] (n=3)"}
    small = [(label["text"], round(label["size"], 1)) for label in labels if label["size"] < 12]
    assert not small, small
    assert overlapping(labels) == []


@needs_chromium
def test_the_page_renders_in_a_headless_browser(workspace, tmp_path):
    from PIL import Image

    page = tmp_path / "report.html"
    assert cli("report", str(workspace), "--output", str(page), cwd=tmp_path).returncode == 0
    cards = measure_text(page.read_text(), "div.grid > div.card", tmp_path)
    assert len(cards) == 6
    assert all(card["w"] > 400 for card in cards)  # six charts, two a row at 1000 px
    # The charts' text (ticks, legends, titles) is readable at page width too.
    texts = measure_text(page.read_text(), "div.grid svg text", tmp_path)
    small = {(t["text"], round(t["size"], 1)) for t in texts if t["size"] < 12}
    assert not small, small
    facts = {f["text"] for f in measure_text(page.read_text(), "div.card.fact", tmp_path)}
    assert f"torch{torch.__version__}" in facts
    assert "devicecpu" in facts
    shot = tmp_path / "shot.png"
    result = run(["--window-size=1280,2400", f"--screenshot={shot}", page.as_uri()], tmp_path / "profile")
    assert result.returncode == 0, result.stderr[-2000:]
    image = Image.open(shot).convert("RGB")
    assert image.size == (1280, 2400)
    pixels = np.asarray(image).reshape(-1, 3).astype(int)
    # Not blank: text, cards and chart lines are painted over the page's light background (a
    # blank or failed page has no dark pixel at all)...
    assert (pixels.min(axis=1) < 200).sum() > 0.005 * len(pixels)
    # ...and the charts' curves, in matplotlib's first colour (#1f77b4), are among them.
    r, g, b = pixels.T
    assert ((b > 150) & (r < 80) & (g > 90) & (g < 150)).sum() > 500
