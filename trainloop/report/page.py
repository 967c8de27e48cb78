"""A run's report: one self-contained HTML page made from what its workspace holds.

``trainloop report WORKSPACE`` (or ``write_report``) reads ``settings.json``, ``metrics.jsonl``,
``trace.jsonl``, ``runs.jsonl`` and the checkpoints, and writes a page with the metric curves,
the machine weighted by the run's trace, the declared hooks beside the states they act in with
their schedules, the time spent per state, the retries, the runs (and
the signals or errors that ended them) and the checkpoints, the best one marked. Everything is
inline (SVG, CSS): the page opens anywhere, without network access.
"""

from __future__ import annotations

import html
import json
import signal
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from trainloop.checkpoint.best import BEST_FILE, read_best
from trainloop.checkpoint.files import LATEST, checkpoint_steps
from trainloop.machine.diagram import draw
from trainloop.machine.table import TRANSITIONS, State, Transition
from trainloop.machine.trace import TraceSummary, read_trace, summarize_trace
from trainloop.metrics import METRICS_FILE, read_metrics
from trainloop.report.style import STYLE
from trainloop.result import RUNS_FILE, read_runs

__all__ = ["ReportError", "build_report", "machine_svg", "write_report"]

REPORT_FILE = "report.html"

class ReportError(ValueError):
    """The workspace cannot be reported on; the message names the path."""


def write_report(workspace: Path | str, output: Path | str | None = None) -> Path:
    """Write the report of ``workspace`` to ``output`` (default ``<workspace>/report.html``).

    Raises:
        ReportError: ``workspace`` is not a run's workspace, or a file in it is malformed.
        OSError: The output cannot be written.
    """
    workspace = Path(workspace)
    target = Path(output) if output is not None else workspace / REPORT_FILE
    page = build_report(workspace)
    target.write_text(page, encoding="utf-8")
    return target


def build_report(workspace: Path) -> str:
    """The report page of ``workspace`` as HTML text.

    Raises:
        ReportError: ``workspace`` has no ``settings.json`` (no run recorded there), or one of
            its files is malformed.
    """
    settings_file = workspace / "settings.json"
    if not settings_file.is_file():
        raise ReportError(
            f"{workspace}: no settings.json, so no run was recorded there (a run writes it in its workspace)"
        )
    try:
        settings = json.loads(settings_file.read_text(encoding="utf-8"))
        metrics = read_metrics(workspace / METRICS_FILE) if (workspace / METRICS_FILE).is_file() else None
        trace = read_trace(workspace / "trace.jsonl") if (workspace / "trace.jsonl").is_file() else None
    except ValueError as error:
        raise ReportError(str(error)) from None
    if not isinstance(settings, dict):
        raise ReportError(f"{settings_file}: not the settings of a run (a JSON object)")
    # Files edited or written by something else: what is not what trainloop writes is left out,
    # and said on the page, rather than ending the report.
    notes: list[str] = []
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
        _overview(metrics or [], summary, runs, checkpoints),
        "<h2>The machine</h2>",
        _machine(summary),
        _hooks(settings),
        _time_per_state(summary),
        "<h2>Metrics</h2>",
        _charts(metrics, best_step),
        "<h2>Runs</h2>",
        _runs(runs),
        "<h2>Checkpoints</h2>",
        _checkpoint_table(checkpoints),
        "<h2>Settings</h2>",
        f"<pre>{_e(json.dumps(settings, indent=2))}</pre>",
    ]
    body = "\n".join(parts)
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>trainloop report: {_e(workspace.resolve().name)}</title><style>{STYLE}</style></head>"
        f"<body><main>\n{body}\n</main></body></html>\n"
    )


# -- sections -------------------------------------------------------------------------------------


def _overview(metrics: list[dict[str, Any]], summary: TraceSummary | None, runs: list[dict[str, Any]],
              checkpoints: list[dict[str, Any]]) -> str:
    steps = max([r["step"] for r in metrics] + [r.get("step", 0) for r in runs] + [summary.steps if summary else 0])
    retries = _fired(summary, lambda t: t.dest is State.RETRYING) if summary else None
    cards = [("steps", str(steps)), ("runs", str(len(runs) or (summary.runs if summary else "?")))]
    for key in ("loss", "val/loss", "val/accuracy"):
        value = next((r[key] for r in reversed(metrics) if key in r), None)
        if value is not None:
            cards.append((f"last {key}{_window(metrics) if key == 'loss' else ''}", f"{value:.4g}"))
    cards.append(("retries", "not traced" if retries is None else str(retries)))
    cards.append(("checkpoints", str(len(checkpoints))))
    return (
        '<div class="stats">'
        + "".join(f'<div class="card"><span class="muted">{_e(k)}</span><b>{_e(v)}</b></div>' for k, v in cards)
        + "</div>"
    )


def _window(metrics: list[dict[str, Any]]) -> str:
    """The steps the last logged training loss averages, as a label: `` (mean of steps 391-400)``.

    A ``LoggingHook`` logs the mean over the steps since its previous record.
    """
    steps = [int(r["step"]) for r in metrics if "loss" in r]
    if not steps:
        return ""
    first = steps[-2] + 1 if len(steps) > 1 and steps[-2] < steps[-1] else 1
    return f" (mean of step {steps[-1]})" if first == steps[-1] else f" (mean of steps {first}-{steps[-1]})"


def _charts(metrics: list[dict[str, Any]] | None, best_step: int | None) -> str:
    if metrics is None:
        return f'<p class="muted">No {METRICS_FILE} in this workspace (settings.metrics_file off).</p>'
    if not metrics:
        return f'<p class="muted">{METRICS_FILE} holds no records: nothing was logged.</p>'
    from trainloop.report.charts import group_metrics, group_title, metric_chart  # matplotlib: only for a report

    out = ['<div class="grid">']
    for group, curves in group_metrics(metrics).items():
        for key, points in curves.items():
            chart = metric_chart(key, {key: points}, best_step if group == "val" else None)
            out.append(
                f'<div class="card" title="{_e(chart.title)}">'
                f'<span class="muted">{_e(group_title(group))}</span>{chart.svg}</div>'
            )
    out.append("</div>")
    return "\n".join(out)


def machine_svg(counts: Mapping[tuple[State, State, str], int] | None = None) -> str | None:
    """The machine drawn by Graphviz as SVG markup (``None`` when ``dot`` is not installed).

    With ``counts`` (a trace's), edges are weighted by how often they fired and ``fail`` edges
    that never fired are folded away; without, every ``fail`` edge is folded away.
    """
    from trainloop.report.graphviz import GraphvizError, render_dot

    table = _drawn_table(counts)
    try:
        svg = render_dot(draw(table, "dot", counts=counts), "svg").decode("utf-8")
    except GraphvizError:
        return None
    return svg[svg.index("<svg"):]


def _drawn_table(counts: Mapping[tuple[State, State, str], int] | None) -> list[Transition]:
    return [
        t
        for t in TRANSITIONS
        if t.trigger != "fail" or (counts is not None and counts.get((t.source, t.dest, t.trigger), 0))
    ]


def _machine(summary: TraceSummary | None) -> str:
    counts = summary.counts if summary is not None else None
    note = (
        "Edge width grows with how often an edge fired in this workspace's runs; grey dashed edges never fired; "
        "<code>fail</code> edges (an error in any state ends the run in <code>exiting</code>) "
        "are shown only where one fired."
        if counts is not None
        else 'No trace.jsonl here (run with <code>"trace": true</code> to weigh the edges); <code>fail</code> edges, '
        "from every state to <code>exiting</code> on an error, are left out."
    )
    svg = machine_svg(counts)
    if svg is not None:
        return f'<p class="muted">{note}</p><div class="card diagram">{svg}</div>'
    rows = "".join(
        f"<tr><td>{t.source.value}</td><td>{t.dest.value}</td><td>{_e(t.trigger)}</td><td>{_e(t.condition or '')}</td>"
        f'<td class="num">{"" if counts is None else counts.get((t.source, t.dest, t.trigger), 0)}</td></tr>'
        for t in _drawn_table(counts)
    )
    return (
        f'<p class="muted">{note} Graphviz\'s <code>dot</code> is not installed, so the machine is shown as its table '
        "(install Graphviz and run <code>trainloop report</code> again for the drawing).</p>"
        f"<table><tr><th>from</th><th>to</th><th>trigger</th><th>condition</th><th>fired</th></tr>{rows}</table>"
    )


def _hooks(settings: Mapping[str, Any]) -> str:
    """The hooks ``settings.json`` declares, each beside the state it acts in, with its schedule."""
    declared = [hook for hook in settings.get("hooks") or [] if isinstance(hook, Mapping)]
    if not declared:
        return (
            '<p class="muted">No hooks declared in settings.json '
            "(hooks built in code by <code>build_hooks()</code> are not recorded there).</p>"
        )
    from trainloop.hooks.listing import declared_hook_lines

    rows = "".join(
        f"<tr><td>{_e(state.value if state is not None else 'any')}</td><td>{_e(line)}</td></tr>"
        for state, line in declared_hook_lines(declared)
    )
    return (
        '<p class="muted">The hooks settings.json declares, beside the state each acts in, with its schedule '
        "(hooks built in code by <code>build_hooks()</code> are not recorded there).</p>"
        f"<table><tr><th>state</th><th>hook</th></tr>{rows}</table>"
    )


def _time_per_state(summary: TraceSummary | None) -> str:
    if summary is None or not summary.seconds_in_state:
        return ""
    total = sum(summary.seconds_in_state.values()) or 1.0
    rows = []
    for state, seconds in sorted(summary.seconds_in_state.items(), key=lambda item: -item[1]):
        share = 100.0 * seconds / total
        entered = sum(n for (_, dest, _), n in summary.counts.items() if dest is state)
        rows.append(
            f'<tr><td>{state.value}</td><td class="num">{seconds:.3f} s</td><td class="num">{share:.1f}%</td>'
            f'<td class="num">{entered}</td><td style="width:240px">'
            f'<div class="bar" style="width:{share:.1f}%"></div></td></tr>'
        )
    retries = _fired(summary, lambda t: t.dest is State.RETRYING)
    saves = _fired(summary, lambda t: t.dest is State.CHECKPOINTING)
    return (
        "<h3>Time per state</h3><table><tr><th>state</th><th>time</th><th>share</th><th>entered</th><th></th></tr>"
        + "".join(rows) + "</table>"
        + f'<p>Retries (non-finite gradients): <b>{retries}</b> · checkpoints saved: <b>{saves}</b> · '
        f"runs traced: <b>{summary.runs}</b></p>"
    )


def _fired(summary: TraceSummary, which: Any) -> int:
    return sum(n for (source, dest, trigger), n in summary.counts.items() if which(Transition(trigger, source, dest)))


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


def _runs(runs: list[dict[str, Any]]) -> str:
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
        kind = str(run.get("kind", "train"))  # a line without it: a training run's, written before runs had kinds
        rows.append(
            f'<tr><td class="num">{number}</td><td>{_e(kind)}</td><td>{when}</td><td class="num">{run.get("step")}</td>'
            f'<td class="num">{run.get("epoch")}</td><td class="{"bad" if error or code else ""}">'
            f"{_e(error or ended)}</td></tr>"
        )
    return (
        "<table><tr><th>run</th><th>kind</th><th>ended (UTC)</th><th>step</th><th>epochs</th><th>how it ended</th></tr>"
        + "".join(rows)
        + "</table>"
    )


def _checkpoints(workspace: Path, settings: Mapping[str, Any], notes: list[str]) -> list[dict[str, Any]]:
    """The checkpoints of every ``checkpointing`` hook declared in the settings (or ``checkpoints/``)."""
    roots = []
    hooks = settings.get("hooks")
    for hook in hooks if isinstance(hooks, list) else []:
        if isinstance(hook, Mapping) and hook.get("type") == "checkpointing":
            path = Path(hook["path"] if isinstance(hook.get("path"), str) and hook["path"] else "checkpoints")
            roots.append(path if path.is_absolute() else workspace / path)
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
        latest = (root / LATEST).resolve().name if (root / LATEST).exists() else None
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


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _e(text: str) -> str:
    return html.escape(text, quote=True)
