"""The outcome of a learning-rate range test: the curve, the suggested lr, and its plot."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

__all__ = ["LrFindResult", "steepest_descent"]


@dataclass(frozen=True)
class LrFindResult:
    """The outcome of a learning-rate range test.

    Attributes:
        lrs: The learning rate of each iteration run, increasing exponentially. With several
            param groups it is the lr of the group whose lr was the largest (the others moved
            in proportion).
        losses: The smoothed loss of each iteration (an exponential moving average of
            ``raw_losses``; the same values when ``smoothing`` was 0). Iteration ``i``'s loss
            is computed before its optimizer step, at ``lrs[i]``.
        suggestion: The learning rate at which the smoothed loss fell fastest per unit of
            ``log(lr)`` (its steepest descent; the slope at iteration ``i`` is taken between
            iterations ``i - k`` and ``i + k``, ``k`` = 5% of the iterations run, at least 1).
            The noisy ends are left out: the first tenth of the iterations (or, if longer, the
            moving average's warm-up of ``1 / smoothing`` iterations, at most a quarter) and
            the last ``k``. ``None`` when the loss never fell there or too few iterations ran.
        diverged_at: The learning rate at which the smoothed loss exceeded
            ``divergence_threshold`` times its best value (or the loss became non-finite) and
            the sweep stopped (it is ``lrs[-1]``); ``None`` when the sweep ran to ``end_lr``.
        raw_losses: The loss of each iteration as computed (the mean over its microsteps).
    """

    lrs: tuple[float, ...]
    losses: tuple[float, ...]
    suggestion: float | None
    diverged_at: float | None
    raw_losses: tuple[float, ...]

    def plot(self, path: str | Path) -> Path:
        """Draw the loss against the learning rate (log scale) into a PNG file.

        Shows the raw losses faintly, the smoothed losses, and marks the suggestion and the
        divergence point. Needs matplotlib (imported only here); uses no pyplot state, so it
        neither changes the user's backend nor leaves figures open.

        Args:
            path: The PNG file to write (its directory must exist).

        Returns:
            ``path`` as a ``Path``.

        Raises:
            ImportError: matplotlib is not installed.
        """
        try:
            from matplotlib.figure import Figure
        except ImportError as error:
            raise ImportError("LrFindResult.plot() needs matplotlib: pip install matplotlib") from error
        path = Path(path)
        figure = Figure(figsize=(7, 4.5), layout="tight")
        axes = figure.subplots()
        axes.plot(self.lrs, self.raw_losses, color="tab:blue", alpha=0.3, linewidth=1, label="loss")
        axes.plot(self.lrs, self.losses, color="tab:blue", linewidth=2, label="smoothed loss")
        if self.suggestion is not None:
            axes.axvline(self.suggestion, color="tab:green", linestyle="--",
                         label=f"suggestion {self.suggestion:.3g}")
        if self.diverged_at is not None:
            axes.axvline(self.diverged_at, color="tab:red", linestyle=":",
                         label=f"diverged at {self.diverged_at:.3g}")
        smoothed = [loss for loss in self.losses if math.isfinite(loss)]
        if smoothed:
            # Up to the smoothed curve's top only: raw spikes and a raw blow-up at the end would
            # squash the curve flat. Down to the lowest raw loss, which may lie below it.
            low = min(smoothed + [loss for loss in self.raw_losses if math.isfinite(loss)])
            high = max(smoothed)
            margin = 0.05 * (high - low) or 0.05 * abs(high) or 0.05
            axes.set_ylim(low - margin, high + margin)
        axes.set_xscale("log")
        axes.set_xlabel("learning rate")
        axes.set_ylabel("loss")
        axes.set_title("Learning-rate range test")
        axes.legend()
        figure.savefig(path, format="png")
        return path


def steepest_descent(lrs: list[float], losses: list[float], smoothing: float) -> float | None:
    """The lr where ``d loss / d log(lr)`` is most negative, the noisy ends left out."""
    n = len(losses)
    # The slope is taken across +-5% of the sweep, not between neighbours: batch-to-batch noise
    # that the average still lets through would otherwise win over the real descent.
    half = max(1, n // 20)
    # While the moving average has seen fewer than ~1 / smoothing losses it is the mean of a
    # few batches, whose swings look like descents: skip that warm-up (at most a quarter).
    warm_up = min(math.ceil(1 / smoothing), n // 4) if smoothing else 0
    first, stop = max(half, n // 10, warm_up), n - half
    best_slope, best_lr = 0.0, None
    for i in range(first, stop):
        slope = (losses[i + half] - losses[i - half]) / (math.log(lrs[i + half]) - math.log(lrs[i - half]))
        if slope < best_slope:  # False for NaN: a non-finite neighbour never wins
            best_slope, best_lr = slope, lrs[i]
    return best_lr
