"""The machine drawn as SVG in plain Python: no layout engine, no system package.

The layout is computed from the table, so any states it holds are drawn. The states stand in one
column, in the order the machine reaches them (a topological order of the edges that do not lead
back); an edge to the state just below is a straight line with its label beside it; every other
edge (a back edge, one that skips states) runs in its own lane left of the column, its label on its
own row right beside the state it leaves; an edge from a state to itself loops on the right. The
hooks that act in a state are written beside it. Every label has a row no other text uses, and
the text is monospace, so its width is known here: labels do not overlap at any scale.

``fail`` edges (an error in any state ends the run in ``exiting``) are folded into one line under
the drawing, except those that fired in a run (``counts``).
"""

from __future__ import annotations

import html
import math
import textwrap
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from trainloop.machine.table import FAIL, State, Transition

__all__ = ["EDGE_COLORS", "draw_svg"]

#: Edges into these states are rare and telling: coloured in a drawing of a run that took them.
EDGE_COLORS = {"retrying": "darkorange", "validating": "seagreen", "checkpointing": "royalblue"}

_FONT = 13  # px, every text: still above 12 px when the drawing is scaled to fit a 1000 px window
_CHAR = 0.61  # a monospace glyph's advance, in ems (DejaVu Sans Mono and Menlo: 0.602)
_SLOT = 20  # the height of one stub (an edge leaving or entering a state's side) with its label
_GAP = 36  # between two rows: room for the label of the edge between them
_LANE = 12  # between two lanes
_MARGIN = 14
_MAX_WIDTH = 960  # shown at 926 px (the report's column in a 1000 px window), 13 px text is 12.5 px


def _width(text: str, size: float = _FONT) -> float:
    return len(text) * size * _CHAR


@dataclass
class _Row:
    state: State
    y: float = 0.0
    height: float = 0.0
    slots: list[tuple[Transition, bool]] = field(default_factory=list)  # (edge, leaves here)
    loops: list[Transition] = field(default_factory=list)
    loop_lines: list[list[str]] = field(default_factory=list)  # each loop's label, wrapped to fit the page
    notes: list[str] = field(default_factory=list)


def _order(edges: Sequence[Transition]) -> list[State]:
    """The states in the order the machine reaches them, ignoring edges that lead back.

    A depth-first walk from the first edge's source finds the back edges; the rest form an acyclic
    graph, laid out by Kahn's algorithm that prefers a successor of the state just placed, then
    the state the table names first.
    """
    first_seen: dict[State, int] = {}
    for t in edges:
        first_seen.setdefault(t.source, len(first_seen))
        first_seen.setdefault(t.dest, len(first_seen))
    successors: dict[State, list[State]] = {s: [] for s in first_seen}
    for t in edges:
        if t.dest != t.source and t.dest not in successors[t.source]:
            successors[t.source].append(t.dest)
    back = _back_edges(list(first_seen), successors)
    forward = {s: [d for d in dests if (s, d) not in back] for s, dests in successors.items()}
    indegree = Counter(d for dests in forward.values() for d in dests)
    order: list[State] = []
    ready = [s for s in first_seen if not indegree[s]]
    while ready:
        last = order[-1] if order else None
        ready.sort(key=lambda s: (last is None or s not in forward[last], first_seen[s]))
        order.append(ready.pop(0))
        for d in forward[order[-1]]:
            indegree[d] -= 1
            ready += [d] if not indegree[d] else []
    return order


def _back_edges(states: list[State], successors: Mapping[State, list[State]]) -> set[tuple[State, State]]:
    """The edges a depth-first walk finds leading to a state still on its stack."""
    back: set[tuple[State, State]] = set()
    done: set[State] = set()
    for root in states:
        if root in done:
            continue
        stack, on_stack = [(root, iter(successors[root]))], {root}
        done.add(root)
        while stack:
            state, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                on_stack.discard(state)
            elif child in on_stack:
                back.add((state, child))
            elif child not in done:
                done.add(child)
                on_stack.add(child)
                stack.append((child, iter(successors[child])))
    return back


def _lanes(edges: list[tuple[Transition, int, int]]) -> dict[Transition, int]:
    """A lane per edge that runs beside the column (0: nearest); shortest edges nearest, no overlap."""
    taken: list[list[tuple[int, int]]] = []
    lane_of: dict[Transition, int] = {}
    for t, a, b in sorted(edges, key=lambda e: (abs(e[2] - e[1]), min(e[1], e[2]))):
        low, high = min(a, b), max(a, b)
        lane = next((i for i, spans in enumerate(taken) if all(high < lo or low > hi for lo, hi in spans)), len(taken))
        if lane == len(taken):
            taken.append([])
        taken[lane].append((low, high))
        lane_of[t] = lane
    return lane_of


@dataclass
class _Layout:
    """Where everything goes: the rows of states, and how each edge is drawn."""

    rows: dict[State, _Row]
    straight: list[Transition]  # to the state just below
    lane_of: dict[Transition, int]  # beside the column
    folded: list[Transition]
    box_x: float = 0.0
    box_w: float = 0.0
    label_w: float = 0.0
    width: float = 0.0
    bottom: float = 0.0
    wrapped: dict[State, list[str]] = field(default_factory=dict)


def _layout(table: Sequence[Transition], counts: Mapping[tuple[State, State, str], int],
            notes: Mapping[State, Sequence[str]]) -> _Layout:
    """The rows and the route of each edge (sizes come from :func:`_measure`)."""
    folded = [t for t in table if t.trigger == FAIL and not counts.get((t.source, t.dest, t.trigger))]
    edges = [t for t in table if t not in folded]
    order = _order(edges or list(table))
    index = {s: i for i, s in enumerate(order)}
    layout = _Layout({s: _Row(s, notes=list(notes.get(s, ()))) for s in order}, [], {}, folded)
    beside: list[tuple[Transition, int, int]] = []
    for t in edges:
        if t.source == t.dest:
            layout.rows[t.source].loops.append(t)
        elif index[t.dest] == index[t.source] + 1 and all((s.source, s.dest) != (t.source, t.dest)
                                                           for s in layout.straight):
            layout.straight.append(t)
        else:
            beside.append((t, index[t.source], index[t.dest]))
    lanes = _lanes(beside)
    layout.lane_of = lane_of = {t: lanes[t] for t, _, _ in beside}  # in the table's order
    for t, _, _ in beside:
        layout.rows[t.source].slots.append((t, True))
        layout.rows[t.dest].slots.append((t, False))
    for row in layout.rows.values():
        # A lane from above ends high, nearest lane first; a lane going down starts low, farthest
        # lane first: then no stub crosses a lane of the same state.
        def slot_key(slot: tuple[Transition, bool], i: int = index[row.state]) -> tuple[int, int]:
            t, leaves = slot
            other = index[t.dest] if leaves else index[t.source]
            return (0, lane_of[t]) if other < i else (1, -lane_of[t])

        row.slots.sort(key=slot_key)
    return layout


def _measure(layout: _Layout, label: Callable[[Transition], str], two_lines: bool) -> None:
    """Sizes and positions: label widths are known (monospace), note lines wrapped to fit the page."""
    rows = layout.rows.values()
    layout.box_w = max(_width(row.state.value) * 1.1 for row in rows) + 28
    layout.label_w = max((_width(label(t)) for t in layout.lane_of), default=0.0) + 12
    layout.box_x = _MARGIN + len(set(layout.lane_of.values())) * _LANE + layout.label_w
    out_of_box = layout.box_x + layout.box_w
    right = out_of_box
    for row in rows:
        room = max(16, int((_MAX_WIDTH - _MARGIN - out_of_box - 30) / (_FONT * _CHAR)))
        row.loop_lines = [textwrap.wrap(label(t), room, break_on_hyphens=False) for t in row.loops]
        text_x = _notes_x(row, out_of_box)
        budget = max(16, int((_MAX_WIDTH - _MARGIN - text_x - 12) / (_FONT * _CHAR)))
        lines = [piece for line in row.notes for piece in textwrap.wrap(line, budget) or [""]]
        layout.wrapped[row.state] = lines
        widest = max((_width(line) for line in lines), default=0.0)
        right = max(right, text_x + widest + 12 if lines else text_x - 18)
    y = _MARGIN + 22.0  # room for the start mark
    for row in rows:
        loop_lines = sum(len(lines) for lines in row.loop_lines)
        row.height = max(44.0 if two_lines else 32.0, len(row.slots) * _SLOT + 12, loop_lines * _SLOT + 12,
                         len(layout.wrapped[row.state]) * 17 + 12)
        row.y = y
        y += row.height + _GAP
    layout.width = max(right + _MARGIN, 320.0)
    layout.bottom = y - _GAP


def draw_svg(
    table: Sequence[Transition],
    label: Callable[[Transition], str],
    counts: Mapping[tuple[State, State, str], int] | None = None,
    notes: Mapping[State, Sequence[str]] | None = None,
    seconds: Mapping[State, float] | None = None,
) -> str:
    """The machine of ``table`` as an SVG document (see the module's docstring for the layout).

    Args:
        table: The transitions to draw.
        label: The text of an edge.
        counts: How often each edge fired: line width grows with it, an edge that never fired is
            grey and dashed, and fired ``fail`` edges are drawn rather than folded.
        notes: Lines to write beside a state (the hooks that act in it, with their schedules).
        seconds: Time spent in each state: a state's shade deepens with its share, which it shows.
    """
    layout = _layout(table, counts or {}, notes or {})
    _measure(layout, label, seconds is not None)
    folded_lines = _folded_lines(layout.folded, layout.width)
    width, height = layout.width, layout.bottom + _MARGIN + 18 * len(folded_lines)
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="trainloop-machine" width="{width:.0f}" height="{height:.0f}" '
        f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="DejaVu Sans Mono, Menlo, Consolas, monospace" '
        f'font-size="{_FONT}">',
        '<defs><marker id="tl-arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" markerHeight="7" '
        'markerUnits="userSpaceOnUse" orient="auto">'
        '<path d="M0,0 L10,5 L0,10 z" fill="context-stroke"/></marker></defs>',
        f'<rect width="{width:.0f}" height="{height:.0f}" fill="white"/>',
    ]
    first = next(iter(layout.rows.values()))
    cx, out_of_box = layout.box_x + layout.box_w / 2, layout.box_x + layout.box_w
    out.append(f'<circle cx="{cx:.1f}" cy="{first.y - 18:.1f}" r="5" fill="#1f2328"/>'
               f'<path d="M{cx:.1f},{first.y - 13:.1f} V{first.y:.1f}" stroke="#1f2328" marker-end="url(#tl-arrow)"/>')
    total = sum((seconds or {}).values()) or 1.0
    for row in layout.rows.values():
        out += _state(row, layout.box_x, layout.box_w, (seconds or {}).get(row.state), total if seconds else None)
        out += _loops(row, out_of_box, counts)
        out += _notes(row, layout.wrapped[row.state], _notes_x(row, out_of_box))
    for t in layout.straight:
        out += _straight(t, layout.rows[t.source], layout.rows[t.dest], cx, label(t), _stroke(t, counts))
    for t, lane in layout.lane_of.items():
        lane_x = layout.box_x - layout.label_w - _LANE * lane
        out += _beside(t, layout.rows, layout.box_x, lane_x, label(t), _stroke(t, counts))
    out += _folded(layout.folded, folded_lines, layout.bottom + 16)
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _stub_y(row: _Row, slot: int) -> float:
    return row.y + 6 + (slot + 1) * _SLOT - 2


def _notes_x(row: _Row, out_of_box: float) -> float:
    loops = max((_width(line) for lines in row.loop_lines for line in lines), default=-30.0)
    return out_of_box + 30 + loops + 18


def _stroke(t: Transition, counts: Mapping[tuple[State, State, str], int] | None) -> str:
    """The SVG stroke attributes of an edge, weighted by how often it fired."""
    if counts is None:
        return 'stroke="#d1242f" stroke-dasharray="5 3"' if t.trigger == FAIL else 'stroke="#424a53"'
    fired = counts.get((t.source, t.dest, t.trigger), 0)
    if not fired:
        return 'stroke="#8c959f" stroke-dasharray="5 3"'
    # Logarithmic: a per-microstep edge must not drown the rare ones (retries, saves).
    color = "#d1242f" if t.trigger == FAIL else EDGE_COLORS.get(t.dest.value, "#424a53")
    return f'stroke="{color}" stroke-width="{min(1.0 + 1.2 * math.log10(fired), 6.0):.2f}"'


def _e(text: str) -> str:
    return html.escape(text, quote=True)


def _edge(t: Transition, text: str | list[str], path: str, stroke: str, x: float, y: float,
          anchor: str = "start") -> list[str]:
    """An edge: its line and its label (lines below one another), titled with the whole label."""
    name = f"{t.source.value}->{t.dest.value}"
    lines = [text] if isinstance(text, str) else text
    text = " ".join(lines)
    shown = _e(text) if len(lines) == 1 else "".join(
        f'<tspan x="{x:.1f}" dy="{_SLOT if i else 0}">{_e(line)}</tspan>' for i, line in enumerate(lines)
    )
    return [
        f'<g class="edge" data-edge="{_e(f"{name}:{t.trigger}")}"><title>{_e(name)}: {_e(text)}</title>'
        f'<path d="{path}" fill="none" {stroke} marker-end="url(#tl-arrow)"/>'
        f'<text class="label" x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}" fill="#1f2328">{shown}</text></g>'
    ]


def _state(row: _Row, x: float, w: float, seconds: float | None, total: float | None) -> list[str]:
    share = (seconds or 0.0) / total if total else 0.0
    fill = _shade(share) if total else "#f6f8fa"
    final = row.state.value == "exiting"
    out = [f'<g class="state" data-state="{_e(row.state.value)}">'
           f'<rect x="{x:.1f}" y="{row.y:.1f}" width="{w:.1f}" height="{row.height:.1f}" rx="8" fill="{fill}" '
           f'stroke="#1f2328" stroke-width="{2.5 if final else 1.2}"/>']
    middle = row.y + row.height / 2
    name_y = middle - 2 if total else middle + 5
    out.append(f'<text class="label" x="{x + w / 2:.1f}" y="{name_y:.1f}" text-anchor="middle" font-weight="bold">'
               f"{_e(row.state.value)}</text>")
    if total:
        time = f"{seconds or 0.0:.3g} s · {100 * share:.0f}%"
        out.append(f'<text class="label" x="{x + w / 2:.1f}" y="{middle + 14:.1f}" text-anchor="middle" '
                   f' fill="#1f2328">{_e(time)}</text>')
    out.append("</g>")
    return out


def _shade(share: float) -> str:
    """White for no time, a deep blue for all of it (square root: small shares stay visible)."""
    light, dark = (246, 248, 250), (84, 174, 255)
    k = math.sqrt(max(0.0, min(1.0, share)))
    return "#" + "".join(f"{round(a + (b - a) * k):02x}" for a, b in zip(light, dark))


def _loops(row: _Row, x: float, counts: Mapping[tuple[State, State, str], int] | None) -> list[str]:
    out = []
    slot = 0
    for t, lines in zip(row.loops, row.loop_lines, strict=True):
        y = row.y + 6 + (slot + 1) * _SLOT - 8
        path = f"M{x:.1f},{y - 6:.1f} C{x + 26:.1f},{y - 14:.1f} {x + 26:.1f},{y + 10:.1f} {x + 1:.1f},{y + 4:.1f}"
        out += _edge(t, lines, path, _stroke(t, counts), x + 30, y + 4)
        slot += len(lines)
    return out


def _notes(row: _Row, lines: list[str], x: float) -> list[str]:
    if not lines:
        return []
    width = max(_width(line) for line in lines) + 12
    out = [f'<g class="notes" data-state="{_e(row.state.value)}">'
           f'<rect x="{x:.1f}" y="{row.y:.1f}" width="{width:.1f}" height="{len(lines) * 17 + 8:.1f}" rx="4" '
           'fill="#fff8c5" stroke="#d4a72c"/>']
    out += [f'<text class="label" x="{x + 6:.1f}" y="{row.y + 18 + 17 * i:.1f}" >{_e(line)}</text>'
            for i, line in enumerate(lines)]
    out.append("</g>")
    return out


def _straight(t: Transition, source: _Row, dest: _Row, cx: float, text: str, stroke: str) -> list[str]:
    top, bottom = source.y + source.height, dest.y
    return _edge(t, text, f"M{cx:.1f},{top:.1f} V{bottom:.1f}", stroke, cx + 8, (top + bottom) / 2 + 5)


def _beside(t: Transition, rows: Mapping[State, _Row], box_x: float, lane: float, text: str,
            stroke: str) -> list[str]:
    source, dest = rows[t.source], rows[t.dest]
    y1 = _stub_y(source, source.slots.index((t, True)))
    y2 = _stub_y(dest, dest.slots.index((t, False)))
    path = f"M{box_x:.1f},{y1:.1f} H{lane:.1f} V{y2:.1f} H{box_x:.1f}"
    return _edge(t, text, path, stroke, box_x - 6, y1 - 5, "end")


def _folded_lines(folded: list[Transition], width: float) -> list[str]:
    if not folded:
        return []
    dests = sorted({t.dest.value for t in folded})
    head = f"{FAIL} (an error in any state) → {', '.join(dests)}, from: "
    text = head + ", ".join(t.source.value for t in folded)
    return textwrap.wrap(text, max(30, int((width - 2 * _MARGIN) / (_FONT * _CHAR))))


def _folded(folded: list[Transition], lines: list[str], y: float) -> list[str]:
    if not folded:
        return []
    out = ['<g class="folded">']
    out += [f'<text class="label" x="{_MARGIN}" y="{y + 18 * i + 12:.1f}" fill="#d1242f">{_e(line)}'
            "</text>" for i, line in enumerate(lines)]
    out += [f'<g class="edge folded" data-edge="{_e(f"{t.source.value}->{t.dest.value}:{t.trigger}")}"></g>'
            for t in folded]
    out.append("</g>")
    return out
