"""The report's run facts: the overview cards and the table of runs.

The cards: steps, duration, throughput, device and versions, runs by kind, the last losses.
Read from what the workspace holds: ``runs.jsonl`` (each run's start and end, ``kind``, device and
versions; lines written before those were recorded lack them, and say so), the trace, and the
metrics (a key ending in ``per_s``, ``per_sec`` or ``per_second`` is a throughput, such as the
``items_per_s`` a throughput hook logs; without one, steps per second come from ``step_time``).
"""

from __future__ import annotations

import html
import re
import signal
import statistics
from collections import Counter
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from trainloop.machine.table import State
from trainloop.machine.trace import TraceSummary
from trainloop.report.machine import fired

__all__ = ["duration", "overview", "runs_table", "throughput"]

_THROUGHPUT = re.compile(r"per_s(ec|econd)?$", re.IGNORECASE)
_ENVIRONMENT = ("device", "torch", "trainloop")


def overview(metrics: list[dict[str, Any]], summary: TraceSummary | None, runs: list[dict[str, Any]],
             checkpoints: list[dict[str, Any]]) -> str:
    """The cards at the top of the page."""
    steps = max([r["step"] for r in metrics] + [r.get("step", 0) for r in runs] + [summary.steps if summary else 0])
    retries = fired(summary, lambda t: t.dest is State.RETRYING) if summary else None
    kinds = Counter(str(run.get("kind") or "train") for run in runs)  # lines without a kind: training runs
    count = str(len(runs) or (summary.runs if summary else "?"))
    if kinds and set(kinds) != {"train"}:
        count += " (" + ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items())) + ")"
    cards = [("steps", str(steps)), ("runs", count), duration(runs, summary, metrics)]
    cards += throughput(metrics)
    for key in ("loss", "val/loss", "val/accuracy"):
        value = next((r[key] for r in reversed(metrics) if key in r), None)
        if value is not None:
            cards.append((f"last {key}{_window(metrics) if key == 'loss' else ''}", f"{value:.4g}"))
    cards.append(("retries", "not traced" if retries is None else str(retries)))
    cards.append(("checkpoints", str(len(checkpoints))))
    cards += _environment(runs)
    return (
        '<div class="stats">'
        + "".join(f'<div class="card fact"><span class="muted">{_e(k)}</span><b>{_e(v)}</b></div>' for k, v in cards)
        + "</div>"
    )


def duration(runs: list[dict[str, Any]], summary: TraceSummary | None,
             metrics: list[dict[str, Any]]) -> tuple[str, str]:
    """The workspace's run time as a card: its label says where it was read."""
    spans = [_span(run) for run in runs]
    if runs and all(span is not None for span in spans):
        return "duration (runs.jsonl)", _seconds(sum(span or 0.0 for span in spans))
    if summary is not None and summary.seconds_in_state:
        return "duration (trace)", _seconds(sum(summary.seconds_in_state.values()))
    times = [r["time"] for r in metrics if isinstance(r.get("time"), (int, float))]
    if len(times) > 1:
        return "duration (≥, first to last metrics)", _seconds(max(times) - min(times))
    return "duration", "not recorded"


def throughput(metrics: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """Cards of the last value of each throughput key, else steps/s from the logged ``step_time``."""
    keys = list(dict.fromkeys(k for r in metrics for k in r if _THROUGHPUT.search(k.rsplit("/", 1)[-1])))
    if keys:
        return [(f"{key} (last)", f"{next(r[key] for r in reversed(metrics) if key in r):.4g}") for key in keys[:4]]
    times = [r["step_time"] for r in metrics if isinstance(r.get("step_time"), (int, float)) and r["step_time"] > 0]
    if not times:
        return []
    return [("steps/s (1 / median step_time)", f"{1.0 / statistics.median(times):.4g}")]


def runs_table(runs: list[dict[str, Any]]) -> str:
    """Every run: its kind, when it ended, how long it took, its step, how it ended, and on what."""
    if not runs:
        return '<p class="muted">No runs.jsonl here (written by trainloop as each run ends).</p>'
    rows = []
    for number, run in enumerate(runs, 1):
        code = int(run.get("exit_code") or 0)
        ended = "completed" if code == 0 else f"exit code {code}"
        if code > 128:
            try:
                ended = f"{signal.Signals(code - 128).name} (exit code {code})"
            except ValueError:
                pass
        error = run.get("error")
        when = datetime.fromtimestamp(float(run.get("time", 0)), UTC).strftime("%Y-%m-%d %H:%M:%S")
        span = _span(run)
        on = " · ".join(f"{k} {run[k]}" if k != "device" else str(run[k]) for k in _ENVIRONMENT if run.get(k))
        rows.append(
            f'<tr><td class="num">{number}</td><td>{_e(str(run.get("kind") or "train"))}</td><td>{when}</td>'
            f'<td class="num">{"" if span is None else _seconds(span)}</td><td class="num">{run.get("step")}</td>'
            f'<td class="num">{run.get("epoch")}</td><td class="{"bad" if error or code else ""}">'
            f"{_e(error or ended)}</td><td>{_e(on or 'not recorded')}</td></tr>"
        )
    return (
        "<table><tr><th>run</th><th>kind</th><th>ended (UTC)</th><th>duration</th><th>step</th><th>epochs</th>"
        "<th>how it ended</th><th>on</th></tr>" + "".join(rows) + "</table>"
    )


def _environment(runs: Sequence[dict[str, Any]]) -> list[tuple[str, str]]:
    """Device and versions of the latest run that recorded them."""
    latest = next((run for run in reversed(runs) if any(run.get(k) for k in _ENVIRONMENT)), None)
    if latest is None:
        return [("device, torch, trainloop", "not recorded")]
    return [(key, str(latest.get(key) or "not recorded")) for key in _ENVIRONMENT]


def _span(run: dict[str, Any]) -> float | None:
    started, ended = run.get("started"), run.get("time")
    if not isinstance(started, (int, float)) or not isinstance(ended, (int, float)) or ended < started:
        return None
    return float(ended - started)


def _seconds(seconds: float) -> str:
    """``12.3 s``, ``4 min 05 s``, ``2 h 03 min``."""
    if seconds < 60:
        return f"{seconds:.3g} s"
    minutes, rest = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {rest:02d} s"
    return f"{minutes // 60} h {minutes % 60:02d} min"


def _window(metrics: list[dict[str, Any]]) -> str:
    """The steps the last logged training loss averages, as a label: `` (mean of steps 391-400)``.

    A ``LoggingHook`` logs the mean over the steps since its previous record.
    """
    steps = [int(r["step"]) for r in metrics if "loss" in r]
    if not steps:
        return ""
    first = steps[-2] + 1 if len(steps) > 1 and steps[-2] < steps[-1] else 1
    return f" (mean of step {steps[-1]})" if first == steps[-1] else f" (mean of steps {first}-{steps[-1]})"


def _e(text: str) -> str:
    return html.escape(text, quote=True)
