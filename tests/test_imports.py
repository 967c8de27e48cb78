"""The house's import rules, read from the source with ``ast``.

Every import counts: at module level, under ``if TYPE_CHECKING:`` and inside functions.

- The engine (``core/``, ``settings/``, ``machine/``, ``checkpoint/``, ``distributed/``,
  ``utils.py``) and the hook machinery (``hook_machinery/``) never import the hook library
  (``trainloop.hooks``): a hook tells the engine what it needs through ``BaseHook``.
- No module imports itself back through others: the package has no import cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "trainloop"
ENGINE = ("core", "settings", "machine", "checkpoint", "distributed", "utils", "hook_machinery")
LIBRARY = "trainloop.hooks"


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imported(module: str) -> set[str]:
    """The modules of the package that ``module`` imports anywhere in its source.

    ``from a.b import c`` counts as importing ``a.b.c`` when that is a module, else ``a.b``.
    """
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*parent, *([base] if base else [])])
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        found |= {t for t in targets if t in MODULES and t != module}
    return found


GRAPH = {module: imported(module) for module in MODULES}


def in_library(module: str) -> bool:
    return module == LIBRARY or module.startswith(LIBRARY + ".")


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """The modules that importing ``start`` leads to, through any number of imports."""
    seen: set[str] = set()
    todo = list(graph[start])
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo += graph[node]
    return seen


def in_cycles(graph: dict[str, set[str]]) -> list[str]:
    """The modules that import themselves back through others."""
    return [node for node in sorted(graph) if node in reachable(graph, node)]


@pytest.mark.parametrize("wing", ENGINE)
def test_the_engine_never_imports_the_hook_library(wing):
    engine = [m for m in GRAPH if m == f"trainloop.{wing}" or m.startswith(f"trainloop.{wing}.")]
    assert engine, f"no module in trainloop.{wing}"
    reaching_up = {m: sorted(d for d in GRAPH[m] if in_library(d)) for m in engine}
    assert {m: found for m, found in reaching_up.items() if found} == {}


def test_the_scan_sees_type_only_and_function_level_imports():
    # core/run_state imports BaseHook for types only; report/machine imports the listing inside a function.
    assert "trainloop.hook_machinery.base" in GRAPH["trainloop.core.run_state"]
    assert "trainloop.hook_machinery.listing" in GRAPH["trainloop.report.machine"]
    assert in_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c"]


def test_the_package_has_no_import_cycle():
    assert in_cycles(GRAPH) == []
