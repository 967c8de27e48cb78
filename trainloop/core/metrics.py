"""What a run logged: every ``trainer.log`` call, in memory and in ``<workspace>/metrics.jsonl``.

Each call becomes one flat record: ``{"step": 100, "time": 1700000000.0, "loss": 0.52,
"val/accuracy": 0.97, ...}`` (nested keys joined with ``/``, values as floats, NaN and infinities
as ``null`` since JSON has none). ``step`` and ``time`` are reserved names. A resumed run first
drops the records of steps after the checkpoint it resumed from, so the file holds each step
once, as the run that finished it logged it. A fresh run (nothing resumed) in a workspace whose
file holds an earlier run's records keeps them: the file is renamed ``metrics.1.jsonl`` (the next
free number) and a warning says so, before the new run starts its own ``metrics.jsonl``.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from trainloop.utils import flatten_nested_dict, strict_json, to_float

__all__ = ["METRICS_FILE", "MetricsLog", "read_metrics"]

METRICS_FILE = "metrics.jsonl"
_RESERVED = ("step", "time")


class MetricsLog:
    """The records a run logged, with the last value of every key.

    Attributes:
        history: One flat record per ``trainer.log`` call of this run, in order.
        last: The last value logged for every flattened key (Python floats).
        path: The ``metrics.jsonl`` being appended to, or ``None``.
    """

    def __init__(self) -> None:
        self.history: list[dict[str, float]] = []
        self.last: dict[str, float] = {}
        self.path: Path | None = None
        self._file: IO[str] | None = None

    def open(self, path: Path, resumed_step: int) -> None:
        """Append to ``path`` from now on, first dropping its records of steps after ``resumed_step``.

        Args:
            path: The ``metrics.jsonl`` file (created if missing).
            resumed_step: The step the run starts from (0 for a fresh run): records of later
                steps belong to a run that did not reach its next checkpoint and are redone now.
        """
        self.close()
        path.parent.mkdir(parents=True, exist_ok=True)
        if resumed_step == 0 and path.exists() and path.stat().st_size > 0:
            _keep_earlier_run(path)
        elif path.exists():
            kept = [r for r in read_metrics(path) if r["step"] <= resumed_step]
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text("".join(_line(r) for r in kept), encoding="utf-8")
            tmp.replace(path)  # atomic: a crash here leaves the old file or the new one
        self.path = path
        self._file = path.open("a", encoding="utf-8")

    def record(self, step: int, records: Mapping[str, Any]) -> dict[str, float]:
        """Add one ``trainer.log`` call; returns the flat record.

        Values that are not scalars (a tensor of several elements, a string) are left out:
        the file holds numbers only.
        """
        flat: dict[str, float] = {}
        for key, value in flatten_nested_dict(records).items():
            if key in _RESERVED:
                continue
            try:
                flat[key] = to_float(value, key)  # a host sync per tensor: logging is periodic
            except (TypeError, ValueError):
                continue
        row = {"step": step, "time": time.time(), **flat}
        self.history.append(row)
        self.last.update(flat)
        if self._file is not None:
            self._file.write(_line(row))
            self._file.flush()  # a reader (a report of a live run) sees whole lines
        return row

    def close(self) -> None:
        """Close the file, if any (the in-memory records stay)."""
        if self._file is not None:
            self._file.close()
            self._file = None


def _keep_earlier_run(path: Path) -> None:
    """Rename an earlier run's ``metrics.jsonl`` to the next free ``metrics.<n>.jsonl``, saying so."""
    number = 1
    while (kept := path.with_name(f"{path.stem}.{number}{path.suffix}")).exists():
        number += 1
    path.replace(kept)
    logging.getLogger("trainloop").warning(
        "%s held the records of an earlier run that this fresh run does not continue: kept as %s", path, kept.name
    )


def _line(row: Mapping[str, Any]) -> str:
    return strict_json(row) + "\n"


def read_metrics(path: Path | str) -> list[dict[str, Any]]:
    """Read a ``metrics.jsonl`` back (``null`` values become NaN).

    A last line cut off by a run still writing (or killed) is ignored.

    Raises:
        ValueError: A complete line is not a metrics record; the message names the file and line.
    """
    rows = []
    with Path(path).open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.endswith("\n"):
                break
            try:
                row = json.loads(line)
                row["step"] = int(row["step"])
            except (ValueError, KeyError, TypeError) as error:
                raise ValueError(f"{path}:{number}: not a metrics record ({error})") from None
            rows.append({k: math.nan if v is None else v for k, v in row.items()})
    return rows
