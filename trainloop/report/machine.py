"""The report's machine section: the drawing weighted by the trace, the hooks, the time per state.

The machine is drawn in Python (``trainloop.machine.svg``), so the page needs no system package;
``graphviz=True`` draws it with Graphviz's ``dot`` instead.
"""

from __future__ import annotations

import html
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from trainloop.machine.diagram import draw
from trainloop.machine.table import FAIL, TRANSITIONS, State, Transition
from trainloop.machine.trace import TraceSummary

__all__ = ["fired", "machine_section", "machine_svg"]


def machine_svg(
    counts: Mapping[tuple[State, State, str], int] | None = None,
    notes: Mapping[State, Sequence[str]] | None = None,
    seconds: Mapping[State, float] | None = None,
    graphviz: bool = False,
) -> str:
    """The machine as SVG markup, ready to inline in HTML.

    With ``counts`` (a trace's), edges are weighted by how often they fired; ``fail`` edges are
    shown only where one fired (the Python drawing folds the others into one line).

    Args:
        counts: How often each edge fired.
        notes: Lines beside each state (the hooks that act in it, with their schedules).
        seconds: Time spent per state (the Python drawing shades each state by its share).
        graphviz: Draw with Graphviz's ``dot`` (``seconds`` is then not shown).

    Raises:
        trainloop.report.graphviz.GraphvizError: ``graphviz`` is set and ``dot`` is missing or failed.
    """
    if not graphviz:
        svg = draw(TRANSITIONS, "svg", counts=counts, notes=notes, seconds=seconds)
    else:
        from trainloop.report.graphviz import render_dot

        table = [t for t in TRANSITIONS if t.trigger != FAIL or (counts or {}).get((t.source, t.dest, t.trigger))]
        svg = render_dot(draw(table, "dot", counts=counts, notes=notes), "svg").decode("utf-8")
    return svg[svg.index("<svg"):]


def machine_section(summary: TraceSummary | None, settings: Mapping[str, Any], graphviz: bool = False) -> str:
    """The machine drawn with the run's trace and declared hooks, then the time spent per state."""
    from trainloop.hook_machinery.listing import hook_notes

    counts = summary.counts if summary is not None else None
    lines = _hook_lines(settings)
    note = (
        "Edge width grows with how often an edge fired in this workspace's runs; grey dashed edges never fired; "
        "a state's shade, its share of the run's time. <code>fail</code> edges (an error in any state ends the run "
        "in <code>exiting</code>) are drawn only where one fired."
        if counts is not None
        else 'No trace.jsonl here (run with <code>"trace": true</code> to weigh the edges); <code>fail</code> edges, '
        "from every state to <code>exiting</code> on an error, are folded."
    )
    seconds = summary.seconds_in_state if summary is not None else None
    svg = machine_svg(counts, hook_notes(lines), seconds or None, graphviz)
    return (
        f'<p class="muted">{note} Beside each state: the hooks settings.json declares there, with their schedules.</p>'
        f'<div class="card diagram">{svg}</div>' + _hooks(lines) + _time_per_state(summary)
    )


def _hook_lines(settings: Mapping[str, Any]) -> list[tuple[State | None, str]]:
    declared = [hook for hook in settings.get("hooks") or [] if isinstance(hook, Mapping)]
    if not declared:
        return []
    from trainloop.hook_machinery.listing import declared_hook_lines

    return declared_hook_lines(declared)


def _hooks(lines: list[tuple[State | None, str]]) -> str:
    """The declared hooks, each beside the state it acts in, with its schedule."""
    if not lines:
        return (
            '<p class="muted">No hooks declared in settings.json '
            "(hooks built in code by <code>build_hooks()</code> are not recorded there).</p>"
        )
    rows = "".join(
        f"<tr><td>{_e(state.value if state is not None else 'any')}</td><td>{_e(line)}</td></tr>"
        for state, line in lines
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
    retries = fired(summary, lambda t: t.dest is State.RETRYING)
    saves = fired(summary, lambda t: t.dest is State.CHECKPOINTING)
    return (
        "<h3>Time per state</h3><table><tr><th>state</th><th>time</th><th>share</th><th>entered</th><th></th></tr>"
        + "".join(rows) + "</table>"
        + f'<p>Retries (non-finite gradients): <b>{retries}</b> · checkpoints saved: <b>{saves}</b> · '
        f"runs traced: <b>{summary.runs}</b></p>"
    )


def fired(summary: TraceSummary, which: Callable[[Transition], bool]) -> int:
    """How many times the edges ``which`` selects fired in the trace."""
    return sum(n for (source, dest, trigger), n in summary.counts.items() if which(Transition(trigger, source, dest)))


def _e(text: str) -> str:
    return html.escape(text, quote=True)
