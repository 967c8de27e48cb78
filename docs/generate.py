"""Regenerate the parts of docs/ (and README.md) that are derived from code, so they cannot drift.

Each generated part sits between ``<!-- generated: NAME -->`` and ``<!-- end generated -->``.
``python docs/generate.py`` rewrites them; ``python docs/generate.py --check`` exits 1 if any is
stale, or if ``docs/img/machine.svg`` was drawn from another transition table (the test suite
runs the check).

``python docs/generate.py --pictures`` also redraws the pictures (after a change to the machine's
table, rerun it): ``docs/img/machine.svg`` from ``trainloop.machine.table.TRANSITIONS`` (needs
Graphviz's ``dot``), and ``docs/img/report.png``, a screenshot of the digits demo's
``trainloop report`` page, with ``docs/img/report.outline.json``, the page's outline that
``tests/test_docs.py`` compares with a fresh report of the demo (needs Chromium and
scikit-learn; the demo runs for ~15 s in a temporary directory).
"""

from __future__ import annotations

import hashlib
import html
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from trainloop.hooks.dispatch import HOOK_EVENTS
from trainloop.machine import TRANSITIONS, draw
from trainloop.settings import TrainerSettings

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
MACHINE_SVG = DOCS / "img" / "machine.svg"
REPORT_PNG = DOCS / "img" / "report.png"
REPORT_OUTLINE = DOCS / "img" / "report.outline.json"


def machine_diagram() -> str:
    return "```mermaid\n" + draw(TRANSITIONS, "mermaid") + "```"


def machine_diagram_without_fail() -> str:
    """The README's picture: the table without its ``fail`` edges (one from every state)."""
    return "```mermaid\n" + draw([t for t in TRANSITIONS if t.trigger != "fail"], "mermaid") + "```"


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
        "| `on_schedule` | when the hook's `schedule` is due: `stepping` (after its `on_after_step`); "
        "`exiting` for the last step of a run ended by an exit request; `restoring` with `at_start` |"
    )
    rows.append("| `on_enter_<state>` | on entering `<state>` |")
    return "\n".join(rows)


def example_hook_schedules() -> str:
    """The digits example's declared hooks, each beside the state it acts in, with its schedule."""
    from trainloop.hooks.listing import declared_hook_lines

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
                " or ".join(repr(v) for v in o["enum"]) if "enum" in o else repr(o["const"]) if "const" in o else o.get("type", "any")
                for o in options
            ]
            default = "required" if info.is_required() else f"`{json.dumps(prop.get('default'))}`"
            rows.append(f"| `{field}` | {' or '.join(kinds)} | {default} |")
        parts.append("\n".join(rows) + "\n")
    return "\n".join(parts).rstrip()


GENERATORS = {
    "hooks-reference": hooks_reference,
    "machine-diagram": machine_diagram,
    "machine-diagram-without-fail": machine_diagram_without_fail,
    "transition-table": transition_table,
    "hook-states": hook_states,
    "example-hook-schedules": example_hook_schedules,
    "settings-table": settings_table,
}
PATTERN = re.compile(r"(<!-- generated: ([\w-]+) -->\n)(.*?)(<!-- end generated -->)", re.S)


def render(text: str) -> str:
    """``text`` with every generated part brought up to date."""
    return PATTERN.sub(lambda m: m.group(1) + GENERATORS[m.group(2)]() + "\n" + m.group(4), text)


# -- pictures -------------------------------------------------------------------------------------


def machine_dot() -> str:
    """The DOT source docs/img/machine.svg is drawn from: the whole table, ``fail`` edges included."""
    return draw(TRANSITIONS, "dot")


def source_digest(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def machine_svg_is_current() -> bool:
    """Whether docs/img/machine.svg records the digest of the current table's DOT source."""
    if not MACHINE_SVG.exists():
        return False
    return f"<!-- trainloop machine source {source_digest(machine_dot())} -->" in MACHINE_SVG.read_text()


def draw_machine_svg() -> None:
    from trainloop.report.graphviz import render_dot

    source = machine_dot()
    svg = render_dot(source, "svg").decode()
    start = svg.index("<svg")  # the digest goes after the prolog, where a comment is allowed
    svg = svg[:start] + f"<!-- trainloop machine source {source_digest(source)} -->\n" + svg[start:]
    MACHINE_SVG.write_text(svg)


def report_outline(page: str) -> dict[str, list[str]]:
    """What a report page shows, without its numbers: section and chart titles, the drawn edges."""
    diagram = page[page.index(">The machine<"):page.index("<h2>Runs")]
    return {
        "sections": re.findall(r"<h[23]>(.*?)</h[23]>", page),
        "charts": re.findall(r'<div class="card" title="([^"]+)">', page),
        "machine": sorted({html.unescape(e) for e in re.findall(r"<title>(\w+&#45;&gt;\w+)</title>", diagram)}),
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
        draw_machine_svg()
        draw_report_picture()
    stale = []
    if not machine_svg_is_current():
        if check:
            stale.append(MACHINE_SVG.relative_to(ROOT).as_posix())
        else:
            from trainloop.report.graphviz import GraphvizError

            try:
                draw_machine_svg()
            except GraphvizError as error:
                print(f"docs/img/machine.svg is stale and cannot be redrawn: {error}")
                return 1
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
