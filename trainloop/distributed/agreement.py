"""Agreeing on exit requests across ranks without making any step wait for it, nor paying a
collective on every step."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from trainloop.distributed.ranks import world_size

__all__ = ["AGREE_WITHIN", "MAX_STEPS_BETWEEN", "ExitAgreement"]

#: The ranks compare requests about this often (seconds), so a request is agreed on within
#: about this long plus a step...
AGREE_WITHIN = 0.5
#: ...and within this many steps (+1) however short the steps are.
MAX_STEPS_BETWEEN = 32


class ExitAgreement:
    """Makes every rank stop after the same step when any rank asks to stop.

    The ranks' requests (a signal caught on one node, say) are all-reduced with MAX
    asynchronously at the end of an *agreement step*, and the result is read at the end of the
    next step: all ranks then stop after that same step, and no step blocks on the collective.
    Agreement steps are about ``AGREE_WITHIN`` seconds apart (at most ``MAX_STEPS_BETWEEN``
    steps, at least one): each reduction also carries every rank's proposal for the next gap,
    worked out from its own time per step, and the ranks take the smallest, so they all keep
    the same schedule. A request is therefore agreed on within about half a second plus one
    step (at most ``MAX_STEPS_BETWEEN + 1`` steps), and a run of short steps pays one small CPU
    collective every ``MAX_STEPS_BETWEEN`` steps instead of one per step. The first step is an
    agreement step. The reduction runs on a CPU (gloo) group, so reading it never synchronises
    with an accelerator. Without a process group of two or more ranks a request holds at once.

    Requests are encoded as integers: 0 none, ``1 + exit_code`` otherwise (an exit without a code
    is ``1``), so MAX agrees on the highest exit code asked for.
    """

    def __init__(self) -> None:
        self.active = world_size() > 1
        self._group = None
        self._pending: tuple[dist.Work, torch.Tensor] | None = None
        self._countdown = 1  # steps until the next agreement step (the first step is one)
        self._steps = 0  # since the last agreement step
        self._since: float | None = None  # when it was
        if self.active and dist.get_backend() != "gloo":
            self._group = dist.new_group(backend="gloo")  # a collective: every rank builds it here

    def settle(self, request: int) -> int:
        """Submit this rank's request for this step; return what all ranks agreed on so far."""
        if not self.active:
            return request
        agreed = 0
        self._steps += 1
        self._countdown -= 1
        if self._pending is not None:  # submitted at the end of the previous step
            work, flag = self._pending
            work.wait()
            self._pending = None
            agreed = int(flag[0])  # a CPU tensor: no device sync
            self._countdown = -int(flag[1]) - 1  # the agreed gap, of which this step is one
        if self._countdown <= 0:
            now = time.monotonic()
            flag = torch.tensor([request, -self._proposal(now)], dtype=torch.int64)
            self._pending = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True), flag)
            self._since, self._steps = now, 0
        return agreed

    def _proposal(self, now: float) -> int:
        """This rank's choice of steps to the next agreement step, from its time per step."""
        if self._since is None or now <= self._since:
            return 1
        per_step = (now - self._since) / self._steps
        return max(1, min(MAX_STEPS_BETWEEN, int(AGREE_WITHIN / per_step)))

    def close(self) -> None:
        """Wait for the reduction in flight, so no collective is left dangling at exit."""
        if self._pending is not None:
            self._pending[0].wait()
            self._pending = None
