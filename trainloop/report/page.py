"""A run's report: one self-contained HTML page made from what its workspace holds.

``trainloop report WORKSPACE`` (or ``write_report``) reads ``settings.json``, ``metrics.jsonl``,
``trace.jsonl``, ``runs.jsonl`` and the checkpoints, and writes a page with the run facts
(``facts``: duration, throughput, device, versions, runs by kind), the machine weighted by the
run's trace with the declared hooks beside the states they act in (``machine``), the time spent
per state, one chart per metric family, smoothed (``charts``), the runs (and the signals or
errors that ended them) and the checkpoints, the best one marked. Everything is inline (SVG,
CSS): the page opens anywhere, without network access.
"""

from __future__ import annotations

import html
import json
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from trainloop.checkpoint.best import BEST_FILE, read_best
from trainloop.checkpoint.manager import checkpoint_steps, latest_step
from trainloop.checkpoint.storage import read_bytes
from trainloop.core.metrics import METRICS_FILE, read_metrics
from trainloop.core.result import RUNS_FILE, read_runs
from trainloop.location import Location, StorageError, location
from trainloop.machine.trace import read_trace, summarize_trace
from trainloop.report.facts import overview, runs_table
from trainloop.report.machine import machine_section, machine_svg
from trainloop.report.style import STYLE

__all__ = ["DEFAULT_SMOOTHING", "ReportError", "build_report", "machine_svg", "write_report"]

REPORT_FILE = "report.html"
#: The charts' default smoothing factor (TensorBoard's default too).
DEFAULT_SMOOTHING = 0.6

class ReportError(ValueError):
    """The workspace cannot be reported on; the message names the path."""


def write_report(
    workspace: Path | str,
    output: Path | str | None = None,
    smoothing: float = DEFAULT_SMOOTHING,
    graphviz: bool = False,
) -> Path:
    """Write the report of ``workspace`` to ``output`` (default ``<workspace>/report.html``).

    Args:
        workspace: The run's workspace.
        output: Where to write the page.
        smoothing: The charts' smoothing factor, in ``[0, 1)`` (``0``: none), as :func:`build_report`.
        graphviz: Draw the machine with Graphviz's ``dot`` rather than in Python.

    Raises:
        ReportError: ``workspace`` is not a run's workspace, or a file in it is malformed.
        trainloop.report.graphviz.GraphvizError: ``graphviz`` is set and ``dot`` is missing or failed.
        OSError: The output cannot be written.
    """
    workspace = Path(workspace)
    target = Path(output) if output is not None else workspace / REPORT_FILE
    page = build_report(workspace, smoothing, graphviz)
    target.write_text(page, encoding="utf-8")
    return target


def build_report(workspace: Path, smoothing: float = DEFAULT_SMOOTHING, graphviz: bool = False) -> str:
    """The report page of ``workspace`` as HTML text.

    Args:
        workspace: The run's workspace.
        smoothing: The charts' exponential-moving-average factor, in ``[0, 1)`` (TensorBoard's
            smoothing; ``0``: none); the raw values stay as faint lines.
        graphviz: Draw the machine with Graphviz's ``dot`` rather than in Python.

    Raises:
        ReportError: ``workspace`` has neither ``settings.json`` nor ``runs.jsonl`` (no run recorded there), one of its
            files is malformed, or ``smoothing`` is outside ``[0, 1)``.
        trainloop.report.graphviz.GraphvizError: ``graphviz`` is set and ``dot`` is missing or failed.
    """
    if not 0.0 <= smoothing < 1.0:
        raise ReportError(f"smoothing {smoothing!r} is outside [0, 1): 0 draws the values as they are")
    settings_file = workspace / "settings.json"
    recorded = settings_file.is_file()
    if not recorded and not (workspace / RUNS_FILE).is_file():
        raise ReportError(
            f"{workspace}: no settings.json or {RUNS_FILE}, so no run was recorded there (a run writes them in its "
            "workspace)"
        )
    try:
        # A run that ended while building (build_model raised) recorded its end in runs.jsonl, not its settings.
        settings = json.loads(settings_file.read_text(encoding="utf-8")) if recorded else {}
        metrics = read_metrics(workspace / METRICS_FILE) if (workspace / METRICS_FILE).is_file() else None
        trace = read_trace(workspace / "trace.jsonl") if (workspace / "trace.jsonl").is_file() else None
    except ValueError as error:
        raise ReportError(str(error)) from None
    if not isinstance(settings, dict):
        raise ReportError(f"{settings_file}: not the settings of a run (a JSON object)")
    # Files edited or written by something else: what is not what trainloop writes is left out,
    # and said on the page, rather than ending the report.
    notes: list[str] = [] if recorded else [
        f"No settings.json: no run got past building (a run writes it once it is built); {RUNS_FILE} says how each "
        "ended."
    ]
    metrics = _numbers_only(metrics, notes)
    summary = summarize_trace(trace) if trace is not None else None
    checkpoints = _checkpoints(workspace, settings, notes)
    best_step = next((c["step"] for c in checkpoints if c["best"]), None)
    runs = _checked_runs(read_runs(workspace), workspace / RUNS_FILE, notes)
    parts = [
        f"<h1>Run report: {_e(workspace.resolve().name)}</h1>",
        f'<p class="muted">{_e(str(workspace))} · generated '
        f'{datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")} by trainloop</p>',
        *(f'<p class="bad">{_e(note)}</p>' for note in notes),
        overview(metrics or [], summary, runs, checkpoints),
        "<h2>The machine</h2>",
        machine_section(summary, settings, graphviz),
        "<h2>Metrics</h2>",
        _charts(metrics, best_step, _monitor(checkpoints), _splits(settings), smoothing),
        "<h2>Runs</h2>",
        runs_table(runs),
        "<h2>Checkpoints</h2>",
        _checkpoint_table(checkpoints),
        "<h2>Settings</h2>",
        f"<pre>{_e(json.dumps(settings, indent=2))}</pre>" if recorded else '<p class="muted">No settings.json.</p>',
    ]
    body = "\n".join(parts)
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>trainloop report: {_e(workspace.resolve().name)}</title><style>{STYLE}</style></head>"
        f"<body><main>\n{body}\n</main></body></html>\n"
    )


# -- sections -------------------------------------------------------------------------------------


def _charts(metrics: list[dict[str, Any]] | None, best_step: int | None, monitor: str | None,
            splits: frozenset[str], smoothing: float) -> str:
    if metrics is None:
        return f'<p class="muted">No {METRICS_FILE} in this workspace (settings.metrics_file off).</p>'
    if not metrics:
        return f'<p class="muted">{METRICS_FILE} holds no records: nothing was logged.</p>'
    from trainloop.report.charts import UNSMOOTHED, chart_title, family, group_metrics, metric_chart  # matplotlib

    marked = family(monitor, splits) if monitor else None
    how = (
        f"smoothed (exponential moving average, factor {smoothing:g}, as TensorBoard's); the raw values are the faint "
        "lines; series of fewer than 10 points and the learning rate are drawn as they are"
        if smoothing
        else "not smoothed"
    )
    out = [
        f'<p class="muted">One chart per metric family: <code>val/loss</code> beside <code>loss</code>, each split\'s '
        f"series in its own colour. Curves {how}.</p>",
        '<div class="grid">',
    ]
    for name, curves in group_metrics(metrics, splits).items():
        factor = 0.0 if name in UNSMOOTHED else smoothing
        chart = metric_chart(chart_title(name), curves, best_step if name == marked else None, factor)
        out.append(f'<div class="card" title="{_e(chart.title)}">{chart.svg}</div>')
    out.append("</div>")
    return "\n".join(out)


def _monitor(checkpoints: list[dict[str, Any]]) -> str | None:
    return next((c["monitor"] for c in checkpoints if c["monitor"]), None)


def _splits(settings: Mapping[str, Any]) -> frozenset[str]:
    """The key prefixes that name a split: the usual ones and each declared validation's ``prefix``."""
    from trainloop.report.charts import SPLITS

    hooks = settings.get("hooks")
    declared = [h for h in hooks if isinstance(h, Mapping)] if isinstance(hooks, list) else []
    prefixes = {h.get("prefix") for h in declared if h.get("type") == "validation"}
    return SPLITS | {p for p in prefixes if isinstance(p, str)}


def _numbers_only(metrics: list[dict[str, Any]] | None, notes: list[str]) -> list[dict[str, Any]] | None:
    """The metrics records with only their numeric values; a note per value left out."""
    if metrics is None:
        return None
    kept = []
    for number, row in enumerate(metrics, 1):  # read_metrics keeps every line: row n is line n
        bad = [k for k, v in row.items() if k not in ("step", "time") and not _is_number(v)]
        for key in bad[:3]:
            notes.append(f"{METRICS_FILE}:{number}: {key!r} is not a number ({_short(row[key])}); left out")
        kept.append({k: v for k, v in row.items() if k not in bad})
    return kept


def _checked_runs(runs: list[dict[str, Any]], path: Path, notes: list[str]) -> list[dict[str, Any]]:
    """The runs whose fields are what trainloop writes; a note per run left out."""
    kept = []
    for number, run in enumerate(runs, 1):
        wrong: list[str] = [
            k
            for k in ("step", "epoch", "exit_code")
            if k in run and not (isinstance(run[k], int) and not isinstance(run[k], bool))
        ]
        if "time" in run and not _is_number(run["time"]):
            wrong.append("time")
        if run.get("error") is not None and not isinstance(run["error"], str):
            wrong.append("error")
        if wrong:
            notes.append(
                f"{path.name}: run {number}: {wrong[0]} is {_short(run[wrong[0]])}, "
                "not what trainloop writes; run left out"
            )
            continue
        kept.append(run)
    return kept


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _checkpoints(workspace: Path, settings: Mapping[str, Any], notes: list[str]) -> list[dict[str, Any]]:
    """The checkpoints of every ``checkpointing`` hook declared in the settings (or ``checkpoints/``).

    A hook's URL ``path`` is read with its ``storage_options`` and fsspec's configuration.
    """
    roots: list[Location] = []
    hooks = settings.get("hooks")
    for hook in hooks if isinstance(hooks, list) else []:
        if isinstance(hook, Mapping) and hook.get("type") == "checkpointing":
            declared = hook["path"] if isinstance(hook.get("path"), str) and hook["path"] else "checkpoints"
            options = hook.get("storage_options")
            try:
                path = location(declared, options if isinstance(options, Mapping) else None)
            except StorageError as error:
                notes.append(f"the checkpoints at {declared} are left out: {error}")
                continue
            roots.append(path if not isinstance(path, Path) or path.is_absolute() else workspace / path)
    if not roots and (workspace / "checkpoints").is_dir():
        roots.append(workspace / "checkpoints")
    found = []
    for root in dict.fromkeys(roots):
        best = read_best(root) or {}
        found_scores = best.get("scores")
        scores: dict[str, Any] = found_scores if isinstance(found_scores, dict) else {}
        for name, score in scores.items():
            if score is not None and not _is_number(score):
                notes.append(
                    f"{root / BEST_FILE}: the score of checkpoint {name} is {_short(score)}, not a number; left out"
                )
        latest = str(latest_step(root))
        for step in checkpoint_steps(root):
            metadata = _read_json(root / str(step) / "metadata.json")
            found.append({
                "root": root, "step": step, "time": str(metadata.get("time", "")), "best": best.get("best") == step,
                "score": scores.get(str(step)) if _is_number(scores.get(str(step))) else None,
                "monitor": best.get("monitor") if isinstance(best.get("monitor"), str) else None,
                "latest": latest == str(step),
            })
    return found


def _checkpoint_table(checkpoints: list[dict[str, Any]]) -> str:
    if not checkpoints:
        return '<p class="muted">No checkpoints.</p>'
    monitor = next((c["monitor"] for c in checkpoints if c["monitor"]), None)
    rows = []
    for c in checkpoints:
        marks = ", ".join(m for m, on in (("best", c["best"]), ("latest", c["latest"])) if on)
        score = "" if c["score"] is None else f"{c['score']:.4g}"
        rows.append(
            f'<tr class="{"best" if c["best"] else ""}"><td>{_e(str(c["root"]))}/{c["step"]}</td>'
            f'<td class="num">{c["step"]}</td>'
            f'<td>{_e(c["time"])}</td><td class="num">{score}</td><td>{marks}</td></tr>'
        )
    head = f"<th>{_e(monitor)}</th>" if monitor else "<th>score</th>"
    return f"<table><tr><th>checkpoint</th><th>step</th><th>saved</th>{head}<th></th></tr>" + "".join(rows) + "</table>"


def _read_json(path: Location) -> dict[str, Any]:
    try:
        data = json.loads(read_bytes(path).decode("utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _e(text: str) -> str:
    return html.escape(text, quote=True)
