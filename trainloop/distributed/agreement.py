"""Agreeing on exit requests across ranks without making any step wait for it."""

from __future__ import annotations

import torch
import torch.distributed as dist

from trainloop.distributed.ranks import world_size

__all__ = ["ExitAgreement"]


class ExitAgreement:
    """Makes every rank stop after the same step when any rank asks to stop.

    A rank's request (a signal caught on one node, say) is all-reduced with MAX asynchronously at
    the end of the step it was made in, and the result is read at the end of the next step: all
    ranks then stop after that same step, one step after the first request, and no step blocks on
    the collective. The reduction runs on a CPU (gloo) group, so reading it never synchronises
    with an accelerator. Without a process group of two or more ranks a request holds at once.

    Requests are encoded as integers: 0 none, ``1 + exit_code`` otherwise (an exit without a code
    is ``1``), so MAX agrees on the highest exit code asked for.
    """

    def __init__(self) -> None:
        self.active = world_size() > 1
        self._group = None
        self._pending: tuple[dist.Work, torch.Tensor] | None = None
        if self.active and dist.get_backend() != "gloo":
            self._group = dist.new_group(backend="gloo")  # a collective: every rank builds it here

    def settle(self, request: int) -> int:
        """Submit this rank's request for this step; return what all ranks agreed on so far."""
        if not self.active:
            return request
        agreed = 0
        if self._pending is not None:
            work, flag = self._pending
            work.wait()
            agreed = int(flag.item())  # a CPU tensor: no device sync
        flag = torch.tensor([request], dtype=torch.int64)
        self._pending = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True), flag)
        return agreed

    def close(self) -> None:
        """Wait for the reduction in flight, so no collective is left dangling at exit."""
        if self._pending is not None:
            self._pending[0].wait()
            self._pending = None
