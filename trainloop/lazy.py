"""Package namespaces that import each exported name from its module on first use (PEP 562).

A package's ``__init__`` that imported every name it exports would import their modules'
dependencies too (torch...) for anyone importing one light submodule or asking ``trainloop --help``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(package: str, exports: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A module ``__getattr__`` and ``__dir__`` serving ``exports`` from their modules.

    Args:
        package: The package's ``__name__``.
        exports: Each exported name -> the module that defines it.

    Returns:
        ``(__getattr__, __dir__)`` for the package's namespace. A name is imported on its first
        use and then stored in the namespace, so later uses are plain attribute reads.
    """
    namespace = importlib.import_module(package).__dict__

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *exports})

    return __getattr__, __dir__
