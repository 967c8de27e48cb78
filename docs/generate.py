"""Regenerate the parts of docs/ (and README.md) that are derived from code, so they cannot drift.

Each generated part sits between ``<!-- generated: NAME -->`` and ``<!-- end generated -->``.
``python docs/generate.py`` rewrites them; ``python docs/generate.py --check`` exits 1 if any is
stale, or if a picture drawn from the code is (the test suite runs the check).

``docs/img/machine.svg`` is drawn from ``trainloop.machine.table.TRANSITIONS`` in Python (no
Graphviz): ``python docs/generate.py`` redraws it, ``--check`` fails while it is stale.

``python docs/generate.py --pictures`` also redraws ``docs/img/report.png``, a screenshot of the digits demo's
``trainloop report`` page, with ``docs/img/report.outline.json``, the page's outline that
``tests/docs/test_docs.py`` compares with a fresh report of the demo (needs Chromium and
scikit-learn; the demo runs for ~15 s in a temporary directory).
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from trainloop.hook_machinery.dispatch import HOOK_EVENTS
from trainloop.machine import TRANSITIONS, draw
from trainloop.machine.table import NOTES
from trainloop.settings import TrainerSettings

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
MACHINE_SVG = DOCS / "img" / "machine.svg"
REPORT_PNG = DOCS / "img" / "report.png"
REPORT_OUTLINE = DOCS / "img" / "report.outline.json"


def machine_diagram() -> str:
    return "```mermaid\n" + draw(TRANSITIONS, "mermaid", notes=NOTES) + "```"


def transition_table() -> str:
    rows = ["| from | to | trigger | condition | action |", "|---|---|---|---|---|"]
    rows += [
        f"| {t.source.value} | {t.dest.value} | {t.trigger} | {t.condition or ''} | {t.action or ''} |"
        for t in TRANSITIONS
    ]
    return "\n".join(rows)


def hook_states() -> str:
    rows = ["| hook method | runs in |", "|---|---|"]
    for event, state in HOOK_EVENTS.items():
        where = f"`{state.value}`" if state else f"when `trainer.{event.removeprefix('on_')}()` is called"
        rows.append(f"| `{event}` | {where} |")
    rows.append(
        "| `on_schedule` | when the hook's `schedule` is due: `stepping` (after its `on_after_step`), "
        "`exiting` for the last step of a run ended by an exit request, `restoring` with `at_start`; "
        "a schedule of `state=\"validating\"` (`ValidationHook`'s): always in `validating` |"
    )
    rows.append("| `on_enter_<state>` | on entering `<state>` |")
    return "\n".join(rows)


def example_hook_schedules() -> str:
    """The digits example's declared hooks, each beside the state it acts in, with its schedule."""
    from trainloop.hook_machinery.listing import declared_hook_lines

    declared = json.loads((ROOT / "examples" / "digits" / "settings.json").read_text())["hooks"]
    rows = ["| state | hook |", "|---|---|"]
    rows += [f"| `{state.value if state else 'any'}` | {line} |" for state, line in declared_hook_lines(declared)]
    return "\n".join(rows)


def settings_table() -> str:
    rows = ["| setting | type | default | meaning |", "|---|---|---|---|"]
    schema = TrainerSettings.model_json_schema()["properties"]
    for name, field in TrainerSettings.model_fields.items():
        options = schema[name].get("anyOf", [schema[name]])
        kinds = [" or ".join(repr(v) for v in o["enum"]) if "enum" in o else o.get("type", "?") for o in options]
        default = "required" if field.is_required() else f"`{json.dumps(schema[name].get('default'))}`"
        description = " ".join((field.description or "").split()).replace("|", "\\|")
        rows.append(f"| `{name}` | {' or '.join(kinds)} | {default} | {description} |")
    return "\n".join(rows)


def hooks_reference() -> str:
    import inspect

    from trainloop.hooks import HOOK_TYPES, hook_settings_model

    parts = []
    for name, cls in sorted(HOOK_TYPES.items()):
        summary = (inspect.getdoc(cls) or "").split("\n\n")[0].replace("\n", " ")
        parts.append(f"### `{cls.__name__}` — `\"type\": \"{name}\"`\n\n{summary}\n")
        rows = ["| parameter | type | default |", "|---|---|---|"]
        model = hook_settings_model(cls)
        schema = model.model_json_schema()
        for field, info in model.model_fields.items():
            if field == "type":
                continue
            prop = schema["properties"][field]
            options = prop.get("anyOf", [prop])
            kinds = [
                " or ".join(repr(v) for v in o["enum"])
                if "enum" in o
                else repr(o["const"])
                if "const" in o
                else o.get("type", "any")
                for o in options
            ]
            default = "required" if info.is_required() else f"`{json.dumps(prop.get('default'))}`"
            rows.append(f"| `{field}` | {' or '.join(kinds)} | {default} |")
        parts.append("\n".join(rows) + "\n")
    return "\n".join(parts).rstrip()


# -- the architecture: the namespaces' exports and the import graph --------------------------------

PACKAGE = ROOT / "trainloop"
ARCHITECTURE_SVG = DOCS / "img" / "architecture.svg"
#: The documented namespaces, in the order the architecture page teaches them.
NAMESPACES = (
    "trainloop",
    "trainloop.settings",
    "trainloop.machine",
    "trainloop.hooks",
    "trainloop.checkpoint",
    "trainloop.distributed",
    "trainloop.lr_find",
    "trainloop.predict",
    "trainloop.report",
    "trainloop.utils",
)


def namespaces_table() -> str:
    import importlib

    rows = ["| namespace | exports |", "|---|---|"]
    for name in NAMESPACES:
        exports = ", ".join(f"`{n}`" for n in sorted(importlib.import_module(name).__all__, key=str.lower))
        rows.append(f"| `{name}` | {exports} |")
    return "\n".join(rows)


def layout_table() -> str:
    """Each wing (a subpackage) and each top-level module with the first paragraph of its docstring."""
    import ast

    rows = ["| where | modules | what it holds |", "|---|---|---|"]
    paths = sorted(PACKAGE.glob("*/__init__.py")) + sorted(
        p for p in PACKAGE.glob("*.py") if not p.stem.startswith("_")
    )
    for path in paths:
        name = f"{path.parent.name}/" if path.name == "__init__.py" else f"{path.name}"
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        summary = " ".join(doc.split("\n\n")[0].split()).replace("|", "\\|")
        modules = (
            ", ".join(m.stem for m in sorted(path.parent.glob("*.py")) if m.stem != "__init__")
            if name.endswith("/")
            else ""
        )
        rows.append(f"| `{name}` | {modules} | {summary} |")
    return "\n".join(rows)


def wing_of(module: str) -> str | None:
    """The node a module belongs to in the picture: its subpackage, or the top-level module itself
    (``None`` for the facade ``trainloop/__init__.py`` and private modules)."""
    parts = module.split(".")
    if len(parts) < 2 or parts[1].startswith("_"):
        return None
    return parts[1] + "/" if (PACKAGE / parts[1]).is_dir() else parts[1]


def import_graph() -> dict[str, set[str]]:
    """Wing -> the wings it imports (at run time or for types only), from the source with ``ast``."""
    import ast

    modules = {
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__") for p in PACKAGE.rglob("*.py")
    }
    graph: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        source = wing_of(name) if not path.name == "__main__.py" else None
        if source is None:
            continue
        graph.setdefault(source, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [
                    f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                    for a in node.names
                ]
            else:
                continue
            for target in targets:
                wing = wing_of(target) if target.startswith("trainloop.") else None
                if wing is not None and wing != source:
                    graph[source].add(wing)
    return graph


def house_order(graph: dict[str, set[str]]) -> list[str]:
    """The wings from the top of the house down, so that as few imports as possible point up
    (the greedy ordering of Eades, Lin and Smyth: sinks go to the bottom, sources to the top,
    otherwise the wing that imports most and is imported least goes next from the top)."""
    left = {n: set(deps) for n, deps in graph.items()}
    top: list[str] = []
    bottom: list[str] = []
    while left:
        importers = {n: {m for m in left if n in left[m]} for n in left}
        if sinks := sorted(n for n in left if not left[n]):
            bottom[:0] = sinks
        elif sources := sorted(n for n in left if not importers[n]):
            top += sources
        else:
            top.append(max(sorted(left), key=lambda n: len(left[n]) - len(importers[n])))
        for n in (sinks or sources or top[-1:]):
            left.pop(n)
        for deps in left.values():
            deps.difference_update(top + bottom)
    return top + bottom


def architecture_layers(graph: dict[str, set[str]]) -> tuple[list[list[str]], set[tuple[str, str]]]:
    """The wings in rows, lowest first, and the imports that point up (those that close a cycle).

    A wing sits one row above the highest wing it imports downwards; rows are ordered to keep
    the edges short."""
    rank = {n: i for i, n in enumerate(house_order(graph))}
    height: dict[str, int] = {}
    for node in reversed(list(rank)):  # bottom up: every wing it imports downwards is placed
        height[node] = 1 + max((height[d] for d in graph[node] if rank[d] > rank[node]), default=-1)
    # Every cycle has at least one import that does not point down.
    upward = {(a, b) for a in graph for b in graph[a] if height[b] >= height[a]}
    rows: list[list[str]] = [[] for _ in range(1 + max(height.values()))]
    for node in sorted(graph):
        rows[height[node]].append(node)
    for below, row in zip(rows, rows[1:]):
        position = {n: i / max(1, len(below) - 1) for i, n in enumerate(below)}
        row.sort(
            key=lambda n: (
                sum(position[d] for d in graph[n] if d in position) / max(1, sum(d in position for d in graph[n])),
                n,
            )
        )
    return rows, upward


def architecture_svg() -> str:
    """The import graph of the package's wings as an SVG, written without a layout engine."""
    graph = import_graph()
    rows, upward = architecture_layers(graph)
    char, box_h, gap_x, gap_y, margin, top = 7.2, 26, 18, 70, 20, 84
    width_of = {n: round(len(n) * char + 20) for n in graph}
    row_width = [sum(width_of[n] for n in row) + gap_x * (len(row) - 1) for row in rows]
    width = round(max(*row_width, 80 * char) + 2 * margin)  # at least the caption's width
    height = top + len(rows) * (box_h + gap_y) - gap_y + margin
    where: dict[str, tuple[float, float]] = {}  # node -> (centre x, top y)
    for i, row in enumerate(rows):
        y = top + (len(rows) - 1 - i) * (box_h + gap_y)
        x = (width - row_width[i]) / 2
        for n in row:
            where[n] = (x + width_of[n] / 2, y)
            x += width_of[n] + gap_x
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        'font-family="DejaVu Sans Mono, monospace" font-size="12">',
        '<defs><marker id="arrow" viewBox="0 0 8 8" refX="8" refY="4" markerWidth="7" markerHeight="7" orient="auto">'
        '<path d="M0,0 L8,4 L0,8 z" fill="#7f8c8d"/></marker>'
        '<marker id="cycle" viewBox="0 0 8 8" refX="8" refY="4" markerWidth="7" markerHeight="7" orient="auto">'
        '<path d="M0,0 L8,4 L0,8 z" fill="#c0392b"/></marker></defs>',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="{margin}" y="24" font-size="14" font-weight="bold">trainloop: who imports whom</text>',
        f'<text x="{margin}" y="42" fill="#555">A → B: a module of A imports one of B (type-only imports too).</text>',
        f'<text x="{margin}" y="58" fill="#555">'
        "Packages end in /. Red: an import that points up the house, closing a cycle.</text>",
    ]
    for source in sorted(graph):
        for dest in sorted(graph[source]):
            (x1, y1), (x2, y2) = where[source], where[dest]
            colour, marker = ("#c0392b", "cycle") if (source, dest) in upward else ("#95a5a6", "arrow")
            if y1 == y2:  # same row: an arc above it
                path = f"M{x1:.1f},{y1} Q{(x1 + x2) / 2:.1f},{y1 - 40} {x2:.1f},{y2}"
            else:
                start, end = (y1 + box_h, y2) if y1 < y2 else (y1, y2 + box_h)
                path = f"M{x1:.1f},{start} L{x2:.1f},{end}"
            out.append(
                f'<path d="{path}" fill="none" stroke="{colour}" stroke-opacity="0.7" marker-end="url(#{marker})">'
                f"<title>{source} → {dest}</title></path>"
            )
    for node in sorted(graph):
        x, y = where[node]
        fill = "#d6eaf8" if node.endswith("/") else "#f2f3f4"
        out.append(
            f'<g><title>{node}</title><rect x="{x - width_of[node] / 2:.1f}" y="{y}" '
            f'width="{width_of[node]}" height="{box_h}" '
            f'rx="5" fill="{fill}" stroke="#34495e"/>'
            f'<text x="{x:.1f}" y="{y + 17}" text-anchor="middle">{node}</text></g>'
        )
    out.append("</svg>")
    return "\n".join(out) + "\n"


GENERATORS = {
    "hooks-reference": hooks_reference,
    "machine-diagram": machine_diagram,
    "transition-table": transition_table,
    "hook-states": hook_states,
    "example-hook-schedules": example_hook_schedules,
    "settings-table": settings_table,
    "namespaces": namespaces_table,
    "layout": layout_table,
}
PATTERN = re.compile(r"(<!-- generated: ([\w-]+) -->\n)(.*?)(<!-- end generated -->)", re.S)


def render(text: str) -> str:
    """``text`` with every generated part brought up to date."""
    return PATTERN.sub(lambda m: m.group(1) + GENERATORS[m.group(2)]() + "\n" + m.group(4), text)


# -- pictures -------------------------------------------------------------------------------------


def machine_svg() -> str:
    """docs/img/machine.svg: the whole table in Python, ``fail`` edges folded, the table's notes beside their states."""
    return draw(TRANSITIONS, "svg", notes=NOTES)


def machine_svg_is_current() -> bool:
    """Whether docs/img/machine.svg is the drawing of the current table."""
    return MACHINE_SVG.exists() and MACHINE_SVG.read_text() == machine_svg()


def report_outline(page: str) -> dict[str, list[str]]:
    """What a report page shows, without its numbers: section and chart titles, the drawn edges."""
    diagram = page[page.index(">The machine<"):page.index("<h2>Runs")]
    return {
        "sections": re.findall(r"<h[23]>(.*?)</h[23]>", page),
        "charts": re.findall(r'<div class="card" title="([^"]+)">', page),
        "machine": sorted({html.unescape(e) for e in re.findall(r'<g class="edge" data-edge="([^"]+)"', diagram)}),
    }


def run_digits_demo(directory: Path, max_steps: int | None = None) -> Path:
    """Run examples/digits in ``directory`` (shortened to ``max_steps``, if given); return its workspace."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, str(ROOT / "examples" / "digits" / "train.py")]
    if max_steps is not None:
        settings = json.loads((ROOT / "examples" / "digits" / "settings.json").read_text())
        (directory / "settings.json").write_text(json.dumps({**settings, "max_steps": max_steps}))
        command.append("settings.json")
    subprocess.run(command, cwd=directory, env=env, check=True, capture_output=True)
    return directory / "runs" / "digits"


def screenshot(page: Path, output: Path, size: str = "1280,2200") -> None:
    """A headless Chromium screenshot of an HTML file (no network, a fresh profile)."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("--pictures needs Chromium for the report screenshot (apt-get install chromium)")
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run(
            [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={profile}",
             "--hide-scrollbars", f"--window-size={size}", f"--screenshot={output}", page.as_uri()],
            check=True, capture_output=True, timeout=120,
        )


def draw_report_picture() -> None:
    from trainloop.report import write_report

    with tempfile.TemporaryDirectory() as directory:
        run_digits_demo(Path(directory))
        cwd = Path.cwd()
        os.chdir(directory)  # the page then names the workspace as the demo does: runs/digits
        try:
            page = write_report(Path("runs/digits"), Path(directory) / "report.html")
        finally:
            os.chdir(cwd)
        screenshot(page, REPORT_PNG)
        outline = report_outline(page.read_text())
    REPORT_OUTLINE.write_text(json.dumps(outline, indent=2) + "\n")


def main(check: bool, pictures: bool = False) -> int:
    if pictures:
        draw_report_picture()
    stale = []
    if not machine_svg_is_current():
        stale.append(MACHINE_SVG.relative_to(ROOT).as_posix())
        if not check:
            MACHINE_SVG.write_text(machine_svg())
    if ARCHITECTURE_SVG.read_text() != architecture_svg():
        stale.append(ARCHITECTURE_SVG.relative_to(ROOT).as_posix())
        if not check:
            ARCHITECTURE_SVG.write_text(architecture_svg())
    for path in [*sorted(DOCS.glob("*.md")), ROOT / "README.md"]:
        text = path.read_text()
        new = render(text)
        if new != text:
            stale.append(path.name)
            if not check:
                path.write_text(new)
    if check and stale:
        print(f"stale generated docs: {', '.join(stale)}; run python docs/generate.py")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main("--check" in sys.argv, "--pictures" in sys.argv))
