"""The best checkpoints by a logged metric: their scores, kept in ``<checkpoints>/best.json``.

A checkpoint's score is the value of the monitored metric logged at its step (a validation run
at the step of the save, before or right after it). A checkpoint saved at a step where the
metric was not logged has no score and is never a "best" one. The file records every scored
checkpoint still on disk::

    {"monitor": "val/loss", "mode": "min", "scores": {"200": 0.31, "400": 0.27}, "best": 400}
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, StrictStr, ValidationInfo

from trainloop.checkpoint import storage
from trainloop.location import Location, location
from trainloop.utils import hint_for_missing_key, strict_json, to_float

__all__ = ["BEST_FILE", "BestCheckpoints", "Monitor", "check_best", "read_best"]

BEST_FILE = "best.json"


def check_best(keep_best: int, monitor: str | None) -> None:
    """Check that ``keep_best`` and ``monitor`` come together.

    Raises:
        ValueError: One is given without the other.
    """
    if keep_best and monitor is None:
        raise ValueError(f"keep_best={keep_best} needs a monitor (a logged key, e.g. 'val/loss')")
    if monitor is not None and not keep_best:
        raise ValueError(f"monitor={monitor!r} needs keep_best >= 1 (how many best checkpoints to keep)")


def _pairs_with_keep_best(monitor: str | None, info: ValidationInfo) -> str | None:
    # In a hook's settings model info.data holds the fields before this one, so a settings file
    # fails validation; under validate_call it is None and the hook's __init__ checks instead.
    data = info.data or {}
    if "keep_best" in data:
        check_best(data["keep_best"], monitor)
    return monitor


#: A hook parameter naming the metric that ranks checkpoints; it must follow ``keep_best``.
Monitor = Annotated[StrictStr | None, Field(min_length=1, validate_default=True), AfterValidator(_pairs_with_keep_best)]


class BestCheckpoints:
    """Scores of checkpoints by one metric, and which of them are the best.

    Args:
        monitor: The flattened key of the metric, e.g. ``"val/loss"``.
        mode: ``"min"`` if lower is better, ``"max"`` if higher is better.
        keep: How many of the best checkpoints are kept from pruning.

    Attributes:
        scores: Score by checkpoint step (non-finite scores, a diverged run's, are never best).
        observed: ``(step, value)`` of the metric's last logged value in this run, or ``None``.
    """

    def __init__(self, monitor: str, mode: Literal["min", "max"], keep: int) -> None:
        self.monitor = monitor
        self.mode = mode
        self.keep = keep
        self.scores: dict[int, float] = {}
        self.observed: tuple[int, float] | None = None
        self._keys_seen: set[str] = set()  # while the metric is not seen: for a "did you mean"

    def observe(self, step: int, flat: Mapping[str, Any]) -> float | None:
        """Read the metric from flattened logged records, if they hold it; returns its value."""
        if self.monitor not in flat:
            if self.observed is None and len(self._keys_seen) < 1000:
                self._keys_seen.update(flat)
            return None
        value = to_float(flat[self.monitor], self.monitor)
        self.observed = (step, value)
        return value

    def missing_message(self) -> str | None:
        """What to warn about when the metric was never logged in this run, else ``None``."""
        if self.observed is not None:
            return None
        return (
            f"the monitored key {self.monitor!r} never appeared in the logged records, so no "
            f"checkpoint was kept as best{hint_for_missing_key(self.monitor, self._keys_seen)}"
        )

    def score(self, step: int, value: float) -> None:
        """Record the checkpoint of ``step``'s score."""
        self.scores[step] = value

    def ranked(self) -> list[int]:
        """Scored steps, best first (ties: the earlier step first); non-finite scores left out.

        A diverged run logs ``-inf`` or ``inf`` as readily as NaN: whichever way the mode
        ranks it, it is no best checkpoint.
        """
        finite = [(v, s) for s, v in self.scores.items() if math.isfinite(v)]
        sign = 1.0 if self.mode == "min" else -1.0
        return [s for _, s in sorted(finite, key=lambda vs: (sign * vs[0], vs[1]))]

    def kept(self) -> set[int]:
        """The steps kept from pruning: the ``keep`` best."""
        return set(self.ranked()[: self.keep])

    @property
    def best(self) -> int | None:
        """The best step, or ``None`` before any finite score."""
        ranked = self.ranked()
        return ranked[0] if ranked else None

    def load(self, root: Location, there: Iterable[int]) -> None:
        """Read the scores of an earlier run from ``root/best.json``, for the checkpoints still ``there`` (steps).

        Scores of another metric or mode are not taken (they would rank wrongly).
        """
        found = read_best(root)
        if found is None or (found.get("monitor"), found.get("mode")) != (self.monitor, self.mode):
            return
        scores = found.get("scores")
        there = set(there)
        for step, value in (scores.items() if isinstance(scores, dict) else ()):
            if isinstance(value, bool) or not isinstance(value, (int, float, type(None))):
                continue  # not a score (an edited file): the checkpoint is scored again when saved
            if str(step).isdigit() and int(step) in there:
                self.scores[int(step)] = math.nan if value is None else float(value)

    def write(self, root: Location, there: Iterable[int]) -> None:
        """Write ``root/best.json`` atomically, forgetting checkpoints no longer ``there`` (steps)."""
        there = set(there)
        self.scores = {s: v for s, v in self.scores.items() if s in there}
        data = {
            "monitor": self.monitor,
            "mode": self.mode,
            "scores": {str(s): v for s, v in sorted(self.scores.items())},
            "best": self.best,
        }
        storage.write_bytes(root / BEST_FILE, (strict_json(data, indent=2) + "\n").encode())  # inf and NaN as null


def read_best(root: Location | str) -> dict[str, Any] | None:
    """The contents of ``root/best.json``, or ``None`` when there is none (or it is unreadable)."""
    try:
        data = json.loads(storage.read_bytes(location(root) / BEST_FILE).decode("utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
