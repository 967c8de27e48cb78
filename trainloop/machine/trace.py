"""Traces: the transitions a run fired, in memory and as ``<workspace>/trace.jsonl``.

The file also marks the steps ``torch.compile`` spent compiling: a line
``{"time": ..., "step": 1, "compiled": {"seconds": ..., "frames": 1, "recompilation": false, "reasons": []}}``
after that step's ``update`` edge. ``read_trace`` returns the transitions, ``read_compile_marks`` the marks.
And it marks the steps whose update the optimizer skipped on the device (non-finite gradients;
no edge, since the host went on without waiting for the verdict): ``{"time": ..., "step": 7,
"skipped": true}``, written when the loop learns it (normally during the next step's update);
``read_skipped_updates`` returns those steps.
"""

from __future__ import annotations

import json
import time
from collections import Counter, deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, NamedTuple

from trainloop.distributed.ranks import is_rank_zero
from trainloop.machine.table import State, Transition
from trainloop.utils import open_jsonl

__all__ = [
    "CompileMark",
    "Trace",
    "TraceEntry",
    "TraceSummary",
    "read_compile_marks",
    "read_skipped_updates",
    "read_trace",
    "start_run_record",
    "summarize_trace",
]


class CompileMark(NamedTuple):
    """A step that ran ``torch.compile``'s compiler.

    Attributes:
        step: The step.
        seconds: The step's whole wall time (``step_info.step_time``): compiling dominates it.
        frames: How many frames dynamo compiled during the step.
        recompilation: Whether a frame compiled before was compiled again (its guards failed).
        reasons: Dynamo's reason for each recompilation (e.g. ``"tensor 'x' size mismatch at
            index 0. expected 2, actual 3"``); empty for a first compilation.
    """

    step: int
    seconds: float
    frames: int
    recompilation: bool
    reasons: tuple[str, ...] = ()

    def describe(self) -> str:
        """One line saying what was compiled and why, for the log."""
        what = "recompiled" if self.recompilation else "compiled"
        why = f": {'; '.join(self.reasons)}" if self.reasons else ""
        return f"torch.compile {what} {self.frames} frame(s) at step {self.step} in {self.seconds:.2f}s{why}"


class TraceEntry(NamedTuple):
    """A transition that fired: when (``time.time()``), at which step, from where to where."""

    time: float
    step: int
    source: State
    dest: State
    trigger: str


class Trace(deque[TraceEntry]):
    """The transitions a run fired, in order, with bounded memory.

    Holds the last ``keep`` entries and counts every edge over the whole run; with a ``path``,
    every entry is also appended to that JSON-lines file (buffered: a write is a memory copy,
    flushed in blocks and on ``close``).

    Args:
        path: A ``trace.jsonl`` file to append to, or ``None``.
        keep: How many of the latest entries to keep in memory.

    Attributes:
        compiled: The steps marked as spent compiling (``mark_compiled``), in order.
        skipped: The steps whose update was skipped on the device (``mark_skipped``), in order.
    """

    def __init__(self, path: Path | None = None, keep: int = 100_000) -> None:
        super().__init__(maxlen=keep)
        self.path = path
        self._counts: Counter[tuple[State, State, str]] = Counter()
        self._file: IO[str] | None = None
        self.compiled: list[CompileMark] = []
        self.skipped: list[int] = []
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open_jsonl(path)  # after a cut-off line of a killed run: a fresh one

    def record(self, transition: Transition, step: int) -> None:
        """Record that ``transition`` fired now, at ``step``."""
        self.append(TraceEntry(time.time(), step, transition.source, transition.dest, transition.trigger))

    def append(self, entry: TraceEntry) -> None:
        """Record one transition."""
        super().append(entry)
        self._counts[(entry.source, entry.dest, entry.trigger)] += 1
        if self._file is not None:
            self._file.write(
                f'{{"time": {entry.time!r}, "step": {entry.step}, "source": "{entry.source.value}", '
                f'"dest": "{entry.dest.value}", "trigger": "{entry.trigger}"}}\n'
            )

    def mark_compiled(self, mark: CompileMark) -> None:
        """Mark ``mark.step`` as a step ``torch.compile`` spent compiling."""
        self.compiled.append(mark)
        if self._file is not None:
            fields = {
                "seconds": mark.seconds,
                "frames": mark.frames,
                "recompilation": mark.recompilation,
                "reasons": list(mark.reasons),
            }
            line = {"time": time.time(), "step": mark.step, "compiled": fields}
            self._file.write(json.dumps(line) + "\n")

    def mark_skipped(self, step: int) -> None:
        """Mark ``step`` as a step whose update the optimizer skipped on the device."""
        self.skipped.append(step)
        if self._file is not None:
            self._file.write(f'{{"time": {time.time()!r}, "step": {step}, "skipped": true}}\n')

    def counts(self) -> Counter[tuple[State, State, str]]:
        """How often each edge ``(source, dest, trigger)`` fired over the whole run."""
        return Counter(self._counts)

    def close(self) -> None:
        """Flush and close the file, if any."""
        if self._file is not None:
            self._file.close()
            self._file = None


def start_run_record(keep: bool, workspace: Path | None) -> Trace | None:
    """The run's trace if ``keep`` (``settings.trace``): ``<workspace>/trace.jsonl`` on rank 0, else in memory.

    With no ``workspace`` (a run that trains nothing) nothing is written: the trace is kept in memory only.
    """
    if not keep:
        return None
    workspace = workspace if is_rank_zero() else None
    if workspace is not None:
        workspace.mkdir(parents=True, exist_ok=True)
    return Trace(workspace / "trace.jsonl" if workspace is not None else None)


def read_trace(path: Path | str) -> list[TraceEntry]:
    """Read a ``trace.jsonl`` back (of a finished run, or of one still writing it).

    Raises:
        ValueError: A line is not a trace entry; the message names the file and line.
    """
    entries = []
    for number, row in _rows(path):
        if "compiled" in row or "skipped" in row:  # a mark, not a transition
            continue
        try:
            entries.append(
                TraceEntry(
                    float(row["time"]),
                    int(row["step"]),
                    State(row["source"]),
                    State(row["dest"]),
                    str(row["trigger"]),
                )
            )
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(f"{path}:{number}: not a trace entry ({error})") from None
    return entries


def read_compile_marks(path: Path | str) -> list[CompileMark]:
    """Read back the steps a ``trace.jsonl`` marks as spent compiling.

    Raises:
        ValueError: A mark is malformed; the message names the file and line.
    """
    marks = []
    for number, row in _rows(path):
        if "compiled" not in row:
            continue
        try:
            fields = row["compiled"]
            marks.append(
                CompileMark(
                    int(row["step"]),
                    float(fields["seconds"]),
                    int(fields["frames"]),
                    bool(fields["recompilation"]),
                    tuple(str(reason) for reason in fields["reasons"]),
                )
            )
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(f"{path}:{number}: not a compile mark ({error})") from None
    return marks


def read_skipped_updates(path: Path | str) -> list[int]:
    """Read back the steps a ``trace.jsonl`` marks as skipped on the device, in the order they were learned.

    Raises:
        ValueError: A mark is malformed; the message names the file and line.
    """
    steps = []
    for number, row in _rows(path):
        if "skipped" not in row:
            continue
        try:
            steps.append(int(row["step"]))
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(f"{path}:{number}: not a skipped-update mark ({error})") from None
    return steps


def _rows(path: Path | str) -> Iterator[tuple[int, dict[str, Any]]]:
    """The JSON objects of a ``trace.jsonl``, numbered from 1 (a line cut off by a run still writing ends it)."""
    with Path(path).open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.endswith("\n"):
                break  # a run still writing: its last line may be cut off
            try:
                row = json.loads(line)
            except ValueError as error:
                raise ValueError(f"{path}:{number}: not a trace entry ({error})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{number}: not a trace entry (not a JSON object)")
            yield number, row


@dataclass(frozen=True)
class TraceSummary:
    """What a trace says about a run.

    Attributes:
        counts: How often each edge ``(source, dest, trigger)`` fired.
        seconds_in_state: Wall time spent in each state (from entering it to leaving it).
        steps: The highest step reached.
        runs: How many runs the trace holds (a resumed run appends to the same file).
    """

    counts: Counter[tuple[State, State, str]] = field(default_factory=Counter)
    seconds_in_state: dict[State, float] = field(default_factory=dict)
    steps: int = 0
    runs: int = 0


def summarize_trace(entries: Iterable[TraceEntry]) -> TraceSummary:
    """Count the edges of a trace and the time spent in each state."""
    counts: Counter[tuple[State, State, str]] = Counter()
    seconds: dict[State, float] = {}
    previous: TraceEntry | None = None
    steps = runs = 0
    for entry in entries:
        runs += entry.trigger == "start"
        counts[(entry.source, entry.dest, entry.trigger)] += 1
        # A resumed run appends to the same file: the gap before its "start" is no state's time.
        if previous is not None and entry.trigger != "start":
            seconds[previous.dest] = seconds.get(previous.dest, 0.0) + (entry.time - previous.time)
        previous = entry
        steps = max(steps, entry.step)
    return TraceSummary(counts, seconds, steps, runs)
