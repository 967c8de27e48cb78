"""The public face, taught the way it is exported, both ways round.

- Every name a documented namespace exports (its ``__all__``) is taught: it appears in code in a
  guide (docs/*.md but the generated API reference, README.md).
- Every ``from trainloop... import X`` and every ``trainloop.x.y`` that the docs (code blocks and
  inline code), README.md and examples/ use resolves through a documented namespace that exports
  it, without a warning.
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest

import trainloop

# the top-level import a training script writes
from trainloop import BaseTrainer, CheckpointingHook, LoggingHook, ProgressHook

ROOT = Path(__file__).resolve().parents[1]

# The documented namespaces: the top level, each wing (a subpackage) and trainloop.utils. The engine
# (core) is reached through the trainer, the hook machinery through trainloop.hooks, and the command
# line is taught as a command (docs/cli.md).
NAMESPACES = [
    "trainloop",
    *sorted(
        f"trainloop.{m.name}" for m in pkgutil.iter_modules(trainloop.__path__) if m.ispkg and m.name not in ("cli", "core", "hook_machinery")
    ),
    "trainloop.utils",
]
GUIDES = [p for p in sorted((ROOT / "docs").glob("*.md")) if p.name != "api.md"] + [ROOT / "README.md"]

FENCE = re.compile(r"^[ \t]*```[^\n]*\n(.*?)^[ \t]*```", re.M | re.S)
INLINE = re.compile(r"(`+)((?:(?!\n\n).)+?)\1", re.S)  # `code` or ``code``, which may wrap a line
FROM_IMPORT = re.compile(r"^\s*from\s+(trainloop(?:\.\w+)*)\s+import\s+(\([^)]*\)|[^\n#]+)", re.M)
DOTTED = re.compile(r"(?<![\w.])trainloop(?:\.\w+)+")


def code_of(path: Path) -> str:
    """The code a file shows: a Python file whole, a Markdown page's fenced blocks and inline code."""
    text = path.read_text()
    if path.suffix == ".py":
        return text
    blocks = FENCE.findall(text)
    return "\n".join([*blocks, *(code for _, code in INLINE.findall(FENCE.sub("", text)))])


def teaching_sources() -> list[Path]:
    return [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md", *sorted((ROOT / "examples").rglob("*.md")), *sorted((ROOT / "examples").rglob("*.py"))]


def uses() -> dict[tuple[str, str | None], list[str]]:
    """(module, name) pairs used in the docs and examples, with where; name None: the module itself."""
    found: dict[tuple[str, str | None], list[str]] = {}
    for path in teaching_sources():
        code = code_of(path)
        where = str(path.relative_to(ROOT))
        for module, names in FROM_IMPORT.findall(code):
            for name in names.strip("()").replace("\n", " ").split(","):
                if name := name.split(" as ")[0].strip():
                    found.setdefault((module, name), []).append(where)
        for dotted in DOTTED.findall(FROM_IMPORT.sub("", code)):
            module, name = split_module(dotted)
            found.setdefault((module, name), []).append(where)
    return found


def split_module(dotted: str) -> tuple[str, str | None]:
    """``trainloop.a.b.c`` as (the longest importable module, the first name after it)."""
    parts = dotted.split(".")
    module, end = parts[0], 1
    while end < len(parts) and hasattr(importlib.import_module(module), "__path__"):
        if importlib.util.find_spec(f"{module}.{parts[end]}") is None:
            break
        module, end = f"{module}.{parts[end]}", end + 1
    return module, (parts[end] if end < len(parts) else None)


def taught_words() -> set[str]:
    return {word for path in GUIDES for word in re.findall(r"\w+", code_of(path))}


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_every_exported_name_resolves_and_is_taught_in_a_guide(namespace):
    module = importlib.import_module(namespace)
    for name in module.__all__:
        getattr(module, name)
    untaught = sorted(set(module.__all__) - taught_words())
    assert not untaught, f"{namespace} exports names no guide (docs/*.md, README.md) shows in code: {untaught}"


def test_every_name_the_docs_and_examples_use_is_exported_by_a_namespace():
    wrong = []
    for (module, name), where in sorted(uses().items(), key=str):
        if name is not None and (module not in NAMESPACES or name not in importlib.import_module(module).__all__):
            wrong.append(f"{module}.{name} is not exported by a namespace ({', '.join(sorted(set(where)))})")
    assert not wrong, "\n".join(wrong)


def test_the_scan_sees_imports_and_dotted_names():
    # The scanner itself: what the two tests above rely on finding.
    found = uses()
    assert ("trainloop", "BaseTrainer") in found  # README's from-import
    assert ("trainloop.distributed", "init_distributed") in found  # an example's
    assert split_module("trainloop.machine.TRANSITIONS") == ("trainloop.machine", "TRANSITIONS")
    assert split_module("trainloop.core.preflight") == ("trainloop.core.preflight", None)


def test_a_training_script_imports_from_the_top_level():
    assert [BaseTrainer.__name__, ProgressHook.__name__, CheckpointingHook.__name__, LoggingHook.__name__] == [
        "BaseTrainer",
        "ProgressHook",
        "CheckpointingHook",
        "LoggingHook",
    ]
    from trainloop.utils import key_average

    assert key_average([{"a": 1.0}, {"a": 3.0}]) == {"a": 2.0}


def test_the_namespaces_import_without_warnings():
    code = "import warnings\nwarnings.simplefilter('error')\nimport " + ", ".join(NAMESPACES)
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_the_architecture_page_lists_every_namespace():
    spec = importlib.util.spec_from_file_location("docs_generate", ROOT / "docs" / "generate.py")
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    assert sorted(generate.NAMESPACES) == sorted(NAMESPACES)  # a new wing is a new row of docs/architecture.md
