"""Regenerate the parts of docs/ (and README.md) that are derived from code, so they cannot drift.

Each generated part sits between ``<!-- generated: NAME -->`` and ``<!-- end generated -->``.
``python docs/generate.py`` rewrites them; ``python docs/generate.py --check`` exits 1 if any is
stale (the test suite runs the check).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from trainloop.hooks.base import HOOK_EVENTS
from trainloop.machine import TRANSITIONS, draw
from trainloop.settings import TrainerSettings

DOCS = Path(__file__).resolve().parent


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
    rows.append("| `on_enter_<state>` | on entering `<state>` |")
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
            kinds = [" or ".join(repr(v) for v in o["enum"]) if "enum" in o else repr(o["const"]) if "const" in o else o.get("type", "any") for o in options]
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
    "settings-table": settings_table,
}
PATTERN = re.compile(r"(<!-- generated: ([\w-]+) -->\n)(.*?)(<!-- end generated -->)", re.S)


def render(text: str) -> str:
    """``text`` with every generated part brought up to date."""
    return PATTERN.sub(lambda m: m.group(1) + GENERATORS[m.group(2)]() + "\n" + m.group(4), text)


def main(check: bool) -> int:
    stale = []
    for path in [*sorted(DOCS.glob("*.md")), DOCS.parent / "README.md"]:
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
    sys.exit(main("--check" in sys.argv))
