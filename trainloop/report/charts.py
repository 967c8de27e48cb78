"""Metric curves of a run as SVG, drawn with matplotlib (imported only here, only when used).

One chart per metric *family*: a key's family is its first segment once a leading split name is
taken off (``records``, under which the logging hook writes what ``forward`` returns, ``train``,
``val``, ``valid``, ``validation``, ``eval``, ``test``, and the ``prefix`` of each declared
``ValidationHook``). So ``loss`` and ``val/loss`` share the chart ``loss``, ``records/accuracy``
and ``val/accuracy`` the chart ``accuracy``, ``lr/group_0`` and ``lr/group_1`` share ``lr``, and
``step_time`` and ``data_time`` share ``time per step (s)``. Curves can be smoothed with an
exponential moving average (TensorBoard's, debiased), the raw values kept as a faint line; the
learning rate is a schedule, not noise, and is never smoothed.
"""

from __future__ import annotations

import io
import math
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

__all__ = ["SPLITS", "UNSMOOTHED", "Chart", "chart_title", "family", "group_metrics", "metric_chart", "smooth"]

#: Leading key segments that name a split of the data rather than a quantity.
SPLITS = frozenset({"records", "train", "val", "valid", "validation", "eval", "test"})
_TRAINING = frozenset({"records", "train"})
_TIME_KEYS = ("step_time", "data_time")
_TITLES = {"time": "time per step (s)"}
_FIRST = ("loss",)  # families shown first; then those with split keys, then the rest, time last
_MAX_POINTS = 2000  # per curve: a long run's SVG stays small, the shape stays visible
UNSMOOTHED = frozenset({"lr"})  # families drawn as they are: a schedule is not noise
_MIN_SMOOTHED = 10  # a series this short (a validation every N steps) is drawn as it is


class Chart(NamedTuple):
    """One chart: its title and its SVG markup (an ``<svg>`` element, ready to inline in HTML)."""

    title: str
    svg: str


def family(key: str, splits: Iterable[str] = SPLITS) -> str:
    """The chart a metric key is drawn on (see the module's docstring).

    Args:
        key: A flat metric key such as ``"val/loss"``.
        splits: The leading segments that name a split.
    """
    if key in _TIME_KEYS:
        return "time"
    parts = key.split("/")
    if len(parts) > 1 and parts[0] in set(splits):
        parts = parts[1:]
    return parts[0]


def group_metrics(
    rows: Iterable[Mapping[str, Any]], splits: Iterable[str] = SPLITS
) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """Series of ``(step, value)`` per key, grouped by :func:`family`, in display order.

    Series that are zero throughout (a retry counter that never moved) are left out.
    """
    splits = frozenset(splits)
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
        groups.setdefault(family(key, splits), {})[key] = points

    def held_out(key: str) -> bool:  # a validation's (or another evaluation's) series, not training's
        return "/" in key and key.split("/", 1)[0] in splits - _TRAINING

    def rank(name: str) -> tuple[int, str]:
        shown = 0 if name in _FIRST else 1 if any(held_out(k) for k in groups[name]) else 3 if name == "time" else 2
        return shown, name

    # Within a chart: the training series first, then the others'.
    return {
        g: dict(sorted(groups[g].items(), key=lambda kv: (held_out(kv[0]), kv[0]))) for g in sorted(groups, key=rank)
    }


def chart_title(name: str) -> str:
    """The title of a family's chart (family names are distinct, and so are the titles)."""
    return _TITLES.get(name, name)


def smooth(values: list[float], factor: float) -> list[float]:
    """TensorBoard's smoothing: an exponential moving average, debiased so it starts at the data.

    Args:
        values: The series.
        factor: In ``[0, 1)``; ``0`` returns the values as they are. A value that is not finite
            is kept as it is and does not enter the average.
    """
    if factor <= 0:
        return list(values)
    out, average, weight = [], 0.0, 0.0
    for value in values:
        if not math.isfinite(value):
            out.append(value)
            continue
        average = factor * average + (1 - factor) * value
        weight = factor * weight + (1 - factor)
        out.append(average / weight)
    return out


def metric_chart(
    title: str,
    curves: Mapping[str, list[tuple[int, float]]],
    best_step: int | None = None,
    smoothing: float = 0.0,
) -> Chart:
    """One chart: the curves against the step axis, as SVG.

    Args:
        title: The chart's title.
        curves: Points per label.
        best_step: A step to mark with a vertical line (the best checkpoint's).
        smoothing: The factor of :func:`smooth`; the raw series stays as a faint line. Series of
            fewer than 10 points are drawn as they are.
    """
    import matplotlib
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    # A salt per chart keeps the ids of several inlined SVGs apart; "none": text stays text.
    with matplotlib.rc_context({"svg.hashsalt": f"trainloop-{title}", "svg.fonttype": "none", "font.size": 10}):
        figure = Figure(figsize=(4.8, 2.6), layout="constrained")
        axes = figure.add_subplot()
        log_scale = True
        for number, (label, points) in enumerate(curves.items()):
            color = f"C{number % 10}"
            values = [v for _, v in points]
            if smoothing > 0 and len(points) >= _MIN_SMOOTHED:  # smoothed over every point, then thinned
                raw = _thin(points)
                axes.plot([s for s, _ in raw], [v for _, v in raw], color=color, linewidth=1.0, alpha=0.25)
                points = list(zip([s for s, _ in points], smooth(values, smoothing), strict=True))
            points = _thin(points)
            axes.plot([s for s, _ in points], [v for _, v in points], color=color, label=_literal(label),
                      linewidth=1.5, marker="o" if len(points) <= 30 else None, markersize=3)
            finite = [v for v in values if math.isfinite(v)]
            log_scale = log_scale and bool(finite) and min(finite) > 0 and max(finite) / min(finite) > 100
        if log_scale:  # a loss falling by orders of magnitude reads better on a log axis
            axes.set_yscale("log")
        if best_step is not None:
            axes.axvline(best_step, color="#d62728", linestyle=":", linewidth=1, label=f"best checkpoint ({best_step})")
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
        axes.set_xlabel("step")
        axes.set_title(_literal(title), loc="left", fontsize=11, fontweight="bold")
        axes.grid(True, alpha=0.3)
        axes.legend(fontsize=10, frameon=False)  # the keys drawn, even one: the title is the family's
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
