"""What ``predict_step`` returns for each batch: checked, moved to the CPU, joined once at the end."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NoReturn

import torch

__all__ = ["PREDICTIONS_KEY", "PredictionError", "PredictionOutputs"]

PREDICTIONS_KEY = "predictions"
"""The name under which a ``predict_step`` that returns one tensor has its outputs saved and returned."""


class PredictionError(TypeError):
    """A ``predict_step`` returned something that is not a tensor or a dict of tensors per item.

    Or tensors whose item shape or dtype differ from the first batch's: the items of all batches
    are joined into one tensor per name, which needs one shape and one dtype (promoting a dtype
    silently would change what ``predict_step`` returned).
    """


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


class PredictionOutputs:
    """The outputs of every batch one rank predicted, by name, in the order the batches came.

    Each batch's tensors are detached and copied to the CPU as they come (a device's memory
    holds one batch's outputs at a time); :meth:`joined` concatenates them once, at the end.

    Args:
        owner: Who returned the outputs, as errors name it (``"MyTrainer.predict_step()"``).
    """

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.batches = 0
        self.items = 0
        self._names: tuple[str, ...] | None = None
        self._parts: dict[str, list[torch.Tensor]] = {}
        self._kinds: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}  # each name's item shape and dtype

    def add(self, returned: Any) -> None:
        """Check what ``predict_step`` returned for the next batch, and keep it.

        Raises:
            PredictionError: It is not a tensor or a dict of tensors with one first dimension
                (the batch's items), or its names, a tensor's item shape (the dimensions after
                the first) or its dtype differ from the first batch's. The error names the batch
                (0-based, in the order this rank drew them).
        """
        outputs = self._checked(returned)
        for name, tensor in outputs.items():
            self._check_kind(name, tensor, not isinstance(returned, torch.Tensor))
        for name, tensor in outputs.items():
            self._parts.setdefault(name, []).append(tensor.detach().cpu())
        self.items += next(iter(outputs.values())).shape[0]
        self.batches += 1

    def joined(self) -> dict[str, torch.Tensor]:
        """The outputs of every item, by name (an empty dict when no batch came)."""
        return {name: torch.cat(parts) for name, parts in self._parts.items()}

    def _checked(self, returned: Any) -> dict[str, torch.Tensor]:
        outputs = {PREDICTIONS_KEY: returned} if isinstance(returned, torch.Tensor) else returned
        if not isinstance(outputs, Mapping):
            self._refuse(f"returned {_describe(returned)}")
        if not outputs:
            self._refuse("returned an empty dict")
        items = set()
        for name, value in outputs.items():
            where = "" if outputs is not returned else f"[{name!r}]"
            if not isinstance(name, str):
                self._refuse(f"returned a dict with the key {name!r}, not a str")
            if not isinstance(value, torch.Tensor) or value.ndim == 0:
                self._refuse(f"returned{where} {_describe(value)}, with no first dimension for the batch's items")
            items.add(value.shape[0])
        if len(items) > 1:
            sizes = ", ".join(f"{name!r}: {value.shape[0]}" for name, value in outputs.items())
            self._refuse(f"returned tensors whose first dimensions differ ({sizes})")
        names = tuple(outputs)
        if self._names is None:
            self._names = names
        elif set(names) != set(self._names):
            self._refuse(f"returned the names {sorted(names)}, the first batch {sorted(self._names)}")
        return dict(outputs)

    def _check_kind(self, name: str, tensor: torch.Tensor, named: bool) -> None:
        """Refuse a tensor whose item shape or dtype is not the first batch's under ``name``."""
        kind = (tuple(tensor.shape[1:]), tensor.dtype)
        first = self._kinds.setdefault(name, kind)
        if kind == first:
            return
        where, batch = f"[{name!r}]" if named else "", self.batches
        if kind[0] != first[0]:
            shape = tuple(tensor.shape)
            said = f"a tensor of shape {shape} for batch {batch}, where batch 0's items have shape {first[0]}"
        else:
            said = f"a {kind[1]} tensor for batch {batch}, where batch 0's is {first[1]} (convert in predict_step)"
        raise PredictionError(
            f"{self.owner} returned{where} {said}: every batch must give items of one shape and one dtype"
        )

    def _refuse(self, problem: str) -> NoReturn:
        raise PredictionError(
            f"{self.owner} {problem} for batch {self.batches}: it must return a tensor, or a dict "
            "of str to tensors, whose first dimension is the batch's items"
        )
