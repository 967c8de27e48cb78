"""Detecting non-finite gradients with one fused kernel per device and dtype, and one host sync."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch
import torch.distributed as dist

__all__ = ["NonFiniteGradCheck"]


class NonFiniteGradCheck:
    """Answers "does any gradient hold inf or NaN?" for a fixed set of parameters.

    It uses the kernel ``GradScaler`` itself uses (``_amp_foreach_non_finite_check_and_unscale_``
    with an inverse scale of 1, so gradients are left untouched): about 10 µs on a small CPU
    model against ~125 µs for an infinity-norm. Buffers are allocated once. Parameters sharded
    as ``DTensor`` (FSDP2) are checked on their local shard and the answer is all-reduced, so
    every rank decides the same.

    Args:
        params: The parameters whose gradients to check.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter]) -> None:
        groups: dict[tuple[torch.device, torch.dtype], list[torch.nn.Parameter]] = defaultdict(list)
        self.sharded = False
        for p in params:
            if p.requires_grad:
                local = _local(p)
                self.sharded |= local is not p
                groups[(local.device, local.dtype)].append(p)
        devices = {device for device, _ in groups}
        self._found = {d: torch.zeros(1, device=d) for d in devices}
        self._inv_scale = {d: torch.ones(1, device=d) for d in devices}
        # Per group, with its device's buffers: nothing is looked up per call.
        self._groups = [(ps, self._found[d], self._inv_scale[d]) for (d, _), ps in groups.items()]
        self._dirty = False

    def __call__(self) -> bool:
        """True if any gradient is non-finite. Synchronises with the device once (per device)."""
        if self._dirty:  # the kernel only ever sets the flag, so clear it after a hit alone
            for found in self._found.values():
                found.zero_()
        sharded = self.sharded
        for params, found, inv_scale in self._groups:
            grads = [_local(p.grad) if sharded else p.grad for p in params if p.grad is not None]
            if grads:
                torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv_scale)
        if sharded and dist.is_available() and dist.is_initialized():
            for found in self._found.values():
                dist.all_reduce(found, op=dist.ReduceOp.MAX)
        # The deliberate host sync of the step: the retry decision needs the answer now.
        dirty = False
        for found in self._found.values():
            dirty = dirty or bool(found.item())
        self._dirty = dirty
        return dirty


def _local(tensor: torch.Tensor) -> torch.Tensor:
    # DTensor keeps its shard in ``_local_tensor``; ``to_local()`` would build a view each call.
    return getattr(tensor, "_local_tensor", tensor)
