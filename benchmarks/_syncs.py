"""Host syncs counted the way trainloop's own test counts them (``SyncCounter`` in tests/support/sync_counter.py).

A host sync is a call of one of the Tensor methods that hand a value to Python and so block the
host until a GPU has caught up. On the CPU nothing waits, but the calls are the same ones a GPU
run would make, so counting them here says how often each library would stall a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType
from typing import Self

# As tests/support/sync_counter.py's SyncCounter.METHODS (tests/processes/test_benchmarks_peers.py checks).
SYNC_METHODS = ("item", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__")


class HostSyncs:
    """Counts calls of ``SYNC_METHODS`` on any Tensor while the ``with`` block runs.

    The methods are wrapped on ``torch.Tensor`` itself (so every library's calls count) and
    restored on exit. The wrappers cost time: count in a separate pass, never while timing.
    """

    def __init__(self) -> None:
        self.count = 0
        self._originals: dict[str, object] = {}  # only the methods torch.Tensor itself defines

    def __enter__(self) -> Self:
        import torch

        for name in SYNC_METHODS:
            original = getattr(torch.Tensor, name)
            if name in vars(torch.Tensor):
                self._originals[name] = original

            def counted(tensor, *args, _original=original, **kwargs):
                self.count += 1
                return _original(tensor, *args, **kwargs)

            setattr(torch.Tensor, name, counted)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        import torch

        for name in SYNC_METHODS:
            if name in self._originals:
                setattr(torch.Tensor, name, self._originals[name])
            else:  # inherited from torch._C.TensorBase: drop the wrapper to uncover it again
                delattr(torch.Tensor, name)
        self._originals.clear()


def syncs_per_step(run: Callable[[Callable[[], None]], object], steps: int, skip: int) -> dict:
    """Host syncs per optimizer update of ``run``, in the steady state.

    Args:
        run: Trains ``steps`` steps, calling the callable it is given after every optimizer update.
        steps: How many steps ``run`` trains.
        skip: Steps left out at the start (lazy first-step work); the window runs from the end of
            step ``skip`` to the end of the last step, so start-up and shut-down are not counted.

    Returns:
        ``{"syncs_per_step": ..., "steps": ...}``, the second being the steps in the window.
    """
    if not 0 < skip < steps:
        raise ValueError(f"need 0 < skip < steps, got skip={skip}, steps={steps}")
    counts: list[int] = []
    with HostSyncs() as syncs:
        run(lambda: counts.append(syncs.count))
    if len(counts) != steps:
        raise RuntimeError(f"the per-step callback ran {len(counts)} times in {steps} steps")
    window = steps - skip
    return {"syncs_per_step": (counts[-1] - counts[skip - 1]) / window, "steps": window}
