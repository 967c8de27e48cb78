"""Metric curves of a run as SVG, drawn with matplotlib (imported only here, only when used)."""

from __future__ import annotations

import io
import math
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

__all__ = ["Chart", "group_metrics", "group_title", "metric_chart"]

#: Groups shown first, in this order, with their titles; any other group follows by name.
_GROUP_TITLES = {"loss": "Training loss", "lr": "Learning rate", "val": "Validation", "time": "Time per step"}
_TIME_KEYS = ("step_time", "data_time")
_MAX_POINTS = 2000  # per curve: a long run's SVG stays small, the shape stays visible


class Chart(NamedTuple):
    """One chart: its title and its SVG markup (an ``<svg>`` element, ready to inline in HTML)."""

    title: str
    svg: str


def group_metrics(rows: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """Series of ``(step, value)`` per key, grouped by the key's first segment (``val/loss``: ``val``).

    ``step_time`` and ``data_time`` form the ``time`` group. Series that are zero throughout (a
    retry counter that never moved) are left out. Groups come in display order.
    """
    series: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        step = int(row["step"])
        for key, value in row.items():
            if key in ("step", "time") or not isinstance(value, (int, float)):
                continue
            series.setdefault(key, []).append((step, float(value)))
    groups: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for key, points in series.items():
        if all(v == 0 for _, v in points):
            continue
        group = "time" if key in _TIME_KEYS else key.split("/", 1)[0]
        groups.setdefault(group, {})[key] = points
    order = [g for g in _GROUP_TITLES if g in groups] + sorted(g for g in groups if g not in _GROUP_TITLES)
    return {g: dict(sorted(groups[g].items())) for g in order}


def group_title(group: str) -> str:
    """The heading of a group of charts."""
    return _GROUP_TITLES.get(group, group)


def metric_chart(title: str, curves: Mapping[str, list[tuple[int, float]]], best_step: int | None = None) -> Chart:
    """One chart: the curves against the step axis, as SVG.

    Args:
        title: The chart's title.
        curves: Points per label.
        best_step: A step to mark with a vertical line (the best checkpoint's).
    """
    import matplotlib
    from matplotlib.figure import Figure

    # A salt per chart keeps the ids of several inlined SVGs apart; "none": text stays text.
    with matplotlib.rc_context({"svg.hashsalt": f"trainloop-{title}", "svg.fonttype": "none", "font.size": 9}):
        figure = Figure(figsize=(4.8, 2.4), layout="constrained")
        axes = figure.add_subplot()
        log_scale = True
        for label, points in curves.items():
            points = _thin(points)
            steps = [s for s, _ in points]
            values = [v for _, v in points]
            axes.plot(
                steps,
                values,
                label=_literal(label),
                linewidth=1.3,
                marker="o" if len(points) <= 30 else None,
                markersize=3,
            )
            finite = [v for v in values if math.isfinite(v)]
            log_scale = log_scale and bool(finite) and min(finite) > 0 and max(finite) / min(finite) > 100
        if log_scale:  # a loss falling by orders of magnitude reads better on a log axis
            axes.set_yscale("log")
        if best_step is not None:
            axes.axvline(best_step, color="#d62728", linestyle=":", linewidth=1, label=f"best checkpoint ({best_step})")
        axes.set_xlabel("step")
        axes.set_title(_literal(title), loc="left", fontsize=10)
        axes.grid(True, alpha=0.3)
        if len(curves) > 1 or best_step is not None:
            axes.legend(fontsize=8, frameon=False)
        buffer = io.StringIO()
        figure.savefig(buffer, format="svg")
    svg = buffer.getvalue()
    return Chart(title, svg[svg.index("<svg"):])  # without the XML prolog: inlined in HTML


def _literal(text: str) -> str:
    """``text`` as matplotlib draws it literally: two ``$`` would start its math mode."""
    return text.replace("$", r"\$")


def _thin(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    if len(points) <= _MAX_POINTS:
        return points
    stride = math.ceil(len(points) / _MAX_POINTS)
    return points[::stride] + ([points[-1]] if (len(points) - 1) % stride else [])
