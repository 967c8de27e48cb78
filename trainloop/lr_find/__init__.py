"""The learning-rate range test: ``lr_find`` (``search``) and what it returns (``result``).

``trainloop.lr_find`` names both this package and its function: once the package is imported, Python
binds the package on ``trainloop`` under that name, so the package is callable and runs the search.
"""

import sys
from types import ModuleType
from typing import Any

from trainloop.lr_find.result import LrFindResult
from trainloop.lr_find.search import LrFindComponents, lr_find

__all__ = ["LrFindComponents", "LrFindResult", "lr_find"]


class _CallablePackage(ModuleType):
    """This package, callable as ``lr_find`` itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> LrFindResult:
        return lr_find(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
