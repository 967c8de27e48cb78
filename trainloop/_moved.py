"""Old import paths of modules and names that moved when the package was laid out in wings.

They still import, with a ``DeprecationWarning`` that names the new path, so code written against
the earlier flat layout keeps working while it is updated. Nothing here imports trainloop's own
modules at import time: the old paths resolve by name, on first use.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

__all__ = ["MOVED_MODULES", "MOVED_NAMES", "install", "moved_names"]

#: Old module path -> the module that holds its contents now.
MOVED_MODULES: dict[str, str] = {
    "trainloop.agreement": "trainloop.distributed.agreement",
    "trainloop.charts": "trainloop.report.charts",
    "trainloop.components": "trainloop.settings.optimizer",
    "trainloop.every": "trainloop.hooks.every",
    "trainloop.graphviz": "trainloop.report.graphviz",
    "trainloop.hooks.exit_signals": "trainloop.exit_signals",
    "trainloop.limits": "trainloop.run_length",
    "trainloop.lr_find_result": "trainloop.lr_find.result",
    "trainloop.ranks": "trainloop.distributed.ranks",
    "trainloop.schedules": "trainloop.settings.schedule",
    "trainloop.settings.preflight": "trainloop.preflight",
    "trainloop.settings_errors": "trainloop.settings.errors",
    "trainloop.settings_input": "trainloop.settings.sources",
    "trainloop.sync": "trainloop.distributed.sync",
    "trainloop.trace": "trainloop.machine.trace",
    "trainloop.types": "trainloop.settings.types",
}

#: Per module that still exists: names it no longer defines -> the module that does.
MOVED_NAMES: dict[str, dict[str, str]] = {
    "trainloop.hooks.checkpointing": dict.fromkeys(
        (
            "LATEST", "CheckpointError", "checkpoint_steps", "latest_checkpoint",
            "read_checkpoint", "write_checkpoint",
        ),
        "trainloop.checkpoint",
    ),
    "trainloop.hooks.base": dict.fromkeys(
        ("HOOK_EVENTS", "HOOK_METHODS", "check_hook_methods", "check_hooks", "hook_dispatch", "state_entry_methods"),
        "trainloop.hooks.dispatch",
    ),
    "trainloop.utils": {
        **dict.fromkeys(("Records", "to_float", "hint_for_missing_key"), "trainloop.nested"),
        **dict.fromkeys(("unwrap_model", "module_modes_kept", "is_distributed_model"), "trainloop.wrappers"),
    },
    "trainloop.step": {"StepInfo": "trainloop.step_info"},
    # (files still uses SHARDED_DIR and load_file itself, so those import from it as before)
    "trainloop.checkpoint.files": {"refused_or_corrupt": "trainloop.checkpoint.loading"},
    # The top level keeps the user's contract; what else it exported lives in a namespace.
    "trainloop": {
        **dict.fromkeys(
            ("TRANSITIONS", "Transition", "Trace", "TraceEntry", "TraceSummary", "read_trace", "summarize_trace"),
            "trainloop.machine",
        ),
        **dict.fromkeys(("LrFindComponents", "LrFindResult"), "trainloop.lr_find"),
        **dict.fromkeys(("flatten_nested_dict", "key_average"), "trainloop.utils"),
    },
}


_OURS = (__file__.rsplit("_moved.py", 1)[0] + "_lazy.py", __file__, "<frozen importlib")


def _warn(old: str, new: str) -> None:
    """Warn that ``old`` moved, at the user's line.

    The line is the first frame outside this machinery and the import system, so Python's default
    filter (which shows the warnings of ``__main__``) shows it, once.
    """
    frame = sys._getframe(1)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_OURS):
        frame = frame.f_back
    registry = frame.f_globals.setdefault("__warningregistry__", {})
    warnings.warn_explicit(
        f"{old} moved to {new}; import it from there", DeprecationWarning, frame.f_code.co_filename,
        frame.f_lineno, module=frame.f_globals.get("__name__", "<unknown>"), registry=registry,
    )


def moved_names(module: str) -> Callable[[str], Any]:
    """A module ``__getattr__`` that serves ``MOVED_NAMES[module]`` from their new modules."""
    moved = MOVED_NAMES[module]

    def __getattr__(name: str) -> Any:
        if name not in moved:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(moved[name]), name)
        # Warned after the import: importing (torch...) may change the warning filters, which
        # resets the registry that shows a warning once per line.
        _warn(f"{module}.{name}", f"{moved[name]}.{name}")
        return value

    return __getattr__


class _OldPath(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old module path as the module that replaced it (the same module object)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        return importlib.util.spec_from_loader(fullname, self) if fullname in MOVED_MODULES else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = MOVED_MODULES[spec.name]
        _warn(spec.name, new)
        module = importlib.import_module(new)
        self._spec = module.__spec__  # the import system overwrites it; exec_module puts it back
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self._spec


def install() -> None:
    """Make the old module paths importable (once per process)."""
    if not any(isinstance(finder, _OldPath) for finder in sys.meta_path):
        sys.meta_path.append(_OldPath())
