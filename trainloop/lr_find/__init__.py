"""The learning-rate range test: ``lr_find`` (``search``) and what it returns (``result``)."""

from trainloop.lr_find.result import LrFindResult
from trainloop.lr_find.search import LrFindComponents, lr_find

__all__ = ["LrFindComponents", "LrFindResult", "lr_find"]
