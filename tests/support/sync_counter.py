"""Counting host syncs the way the tests (and benchmarks/_syncs.py) count them."""

import torch


class SyncCounter:
    """Counts calls of the Tensor methods that block the host until a GPU has caught up."""

    METHODS = ("item", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__")

    def __init__(self, monkeypatch):
        self.count = 0
        for name in self.METHODS:
            original = getattr(torch.Tensor, name)

            def counted(tensor, *args, _original=original, **kwargs):
                self.count += 1
                return _original(tensor, *args, **kwargs)

            monkeypatch.setattr(torch.Tensor, name, counted)
