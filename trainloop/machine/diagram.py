"""The machine drawn from its table: Mermaid ``stateDiagram-v2``, Graphviz DOT source, or SVG drawn in Python."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence

from trainloop.machine.svg import EDGE_COLORS, draw_svg
from trainloop.machine.table import FAIL, TRANSITIONS, State, Transition

__all__ = ["draw"]


# Edges into these states are rare and telling: coloured in a drawing of a run that took them.
_RARE_EDGE_COLORS = {State(name): color for name, color in EDGE_COLORS.items()}


def _label(t: Transition) -> str:
    """``trigger``, then ``[condition]`` and ``/ action()`` when the row has them."""
    label = f"{t.trigger} [{t.condition}]" if t.condition else t.trigger
    return f"{label} / {t.action}()" if t.action else label


def draw(
    table: Iterable[Transition] = TRANSITIONS,
    format: str = "mermaid",
    counts: Mapping[tuple[State, State, str], int] | None = None,
    notes: Mapping[State, Sequence[str]] | None = None,
    seconds: Mapping[State, float] | None = None,
) -> str:
    """Render a transition table as Mermaid ``stateDiagram-v2``, Graphviz DOT source or SVG.

    ``"svg"`` is drawn here, in Python (``trainloop.machine.svg``): no Graphviz needed.

    Args:
        table: The transitions to draw.
        format: ``"mermaid"``, ``"dot"`` or ``"svg"``.
        counts: How often each edge ``(source, dest, trigger)`` fired in a run (e.g.
            ``summarize_trace(...).counts``). Each edge's label then ends with ``(n=<count>)``;
            in DOT the line's width grows with the count, an edge that never fired is grey and
            dashed, and fired edges into ``retrying``, ``validating``, ``checkpointing`` (and ``fail``) are coloured.
        notes: Lines to write beside a state, such as the hooks that act in it with their
            schedules (``trainloop.hook_machinery.listing``).
        seconds: Wall time spent in each state (``summarize_trace(...).seconds_in_state``): in
            SVG each state's shade deepens with its share of the run, which it shows.

    Raises:
        ValueError: ``format`` is none of these.
    """
    table = tuple(table)

    def label(t: Transition) -> str:
        return _label(t) if counts is None else f"{_label(t)} (n={counts.get((t.source, t.dest, t.trigger), 0)})"

    if format == "mermaid":
        return _mermaid(table, label, notes or {})
    if format == "dot":
        return _dot(table, label, counts, notes or {})
    if format == "svg":
        return draw_svg(table, label, counts, notes, seconds)
    raise ValueError(f"unknown diagram format {format!r}; use 'mermaid', 'dot' or 'svg'")


def _mermaid(
    table: tuple[Transition, ...], label: Callable[[Transition], str], notes: Mapping[State, Sequence[str]]
) -> str:
    """The Mermaid ``stateDiagram-v2`` source of :func:`draw`."""
    lines = ["stateDiagram-v2", f"    [*] --> {State.IDLE.value}"]
    lines += [f"    {t.source.value} --> {t.dest.value}: {label(t)}" for t in table]
    lines.append(f"    {State.EXITING.value} --> [*]")
    for state, text in notes.items():
        lines += [f"    note right of {state.value}", *(f"        {line}" for line in text), "    end note"]
    return "\n".join(lines) + "\n"


def _dot(
    table: tuple[Transition, ...],
    label: Callable[[Transition], str],
    counts: Mapping[tuple[State, State, str], int] | None,
    notes: Mapping[State, Sequence[str]],
) -> str:
    """The Graphviz DOT source of :func:`draw`."""
    lines = ["digraph trainloop {", "    rankdir=LR;", "    node [shape=box, style=rounded];"]
    lines.append(f'    "{State.EXITING.value}" [peripheries=2];')
    for t in table:
        attributes = [f'label="{label(t)}"']
        if t.trigger == FAIL:
            attributes.append("style=dashed")
        if counts is not None:
            attributes += _fired_attributes(t, counts.get((t.source, t.dest, t.trigger), 0))
        lines.append(f'    "{t.source.value}" -> "{t.dest.value}" [{", ".join(attributes)}];')
    for state, text in notes.items():
        note = "".join(line.replace("\\", "\\\\").replace('"', '\\"') + "\\l" for line in text)
        lines.append(f'    "{state.value} hooks" [shape=note, fontsize=10, label="{note}"];')
        lines.append(f'    "{state.value}" -> "{state.value} hooks" [style=dotted, arrowhead=none];')
    lines.append("}")
    return "\n".join(lines) + "\n"


def _fired_attributes(t: Transition, fired: int) -> list[str]:
    """The DOT attributes of an edge that fired ``fired`` times in a run."""
    if not fired:
        return ["color=gray70, fontcolor=gray55" + ("" if t.trigger == FAIL else ", style=dashed")]
    # Logarithmic: a per-microstep edge must not drown the rare ones (retries, saves).
    attributes = [f"penwidth={min(1.0 + 1.5 * math.log10(fired), 8.0):.2f}"]
    color = "red" if t.trigger == FAIL else _RARE_EDGE_COLORS.get(t.dest)
    if color is not None:
        attributes.append(f"color={color}, fontcolor={color}")
    return attributes
