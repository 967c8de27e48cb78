"""The top operators of each machine state, from a profile's events (``ProfilerHook`` logs it).

``torch.profiler``'s ``key_averages()`` knows operators, not our states: here each operator is
given to the state whose ``trainloop/<state>`` range encloses its start. The ranges follow one
another on the loop's thread, so a sorted list of their starts finds the state of an operator
on any thread (autograd's included) by bisection.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RANGE_PREFIX", "StateOps", "ops_per_state"]

#: The prefix of the ranges around the states' work: ``trainloop/accumulating``.
RANGE_PREFIX = "trainloop/"

_PROFILER_STEP = "ProfilerStep"  # torch's own range around each profiler step


@dataclass
class StateOps:
    """What a profile spent in one state.

    Attributes:
        entries: How often the state was entered.
        micros: Wall time in the state (the ranges' lengths), µs.
        ops: Per operator: calls, self CPU µs, self device µs.
    """

    entries: int = 0
    micros: float = 0.0
    ops: dict[str, list[float]] = field(default_factory=dict)


def states_of(events: Iterable[Any]) -> dict[str, StateOps]:
    """Per state, in the order first entered: its ranges and the operators they enclose.

    Args:
        events: A profile's ``FunctionEvent`` objects (``profile.events()``).
    """
    events = list(events)
    ranges = sorted(
        (e.time_range.start, e.time_range.end, e.name.removeprefix(RANGE_PREFIX))
        for e in events if e.name.startswith(RANGE_PREFIX)
    )
    states: dict[str, StateOps] = {}
    for start, end, state in ranges:
        ops = states.setdefault(state, StateOps())
        ops.entries += 1
        ops.micros += end - start
    starts = [start for start, _, _ in ranges]
    for e in events:
        if e.name.startswith((RANGE_PREFIX, _PROFILER_STEP)):
            continue
        i = bisect_right(starts, e.time_range.start) - 1
        if i < 0 or e.time_range.start >= ranges[i][1]:
            continue  # between ranges: the profiler's own work at a step boundary
        row = states[ranges[i][2]].ops.setdefault(e.name, [0, 0.0, 0.0])
        row[0] += 1
        row[1] += e.self_cpu_time_total
        row[2] += getattr(e, "self_device_time_total", 0.0)
    return states


def ops_per_state(events: Iterable[Any], top: int) -> str:
    """A table of each state's time and its ``top`` operators by self CPU time, for the log.

    Args:
        events: A profile's ``FunctionEvent`` objects (``profile.events()``).
        top: Operators listed per state.
    """
    states = states_of(events)
    device = any(row[2] for s in states.values() for row in s.ops.values())
    header = ["state", "operator", "calls", "self CPU ms"] + (["self device ms"] if device else [])
    rows = [header]
    for state, found in states.items():
        rows.append([state, f"(in state, {found.entries} entries)", "", f"{found.micros / 1e3:.3f}"] + [""] * device)
        ranked = sorted(found.ops.items(), key=lambda item: item[1][1], reverse=True)[:top]
        for name, (calls, cpu, dev) in ranked:
            rows.append(["", name, str(int(calls)), f"{cpu / 1e3:.3f}"] + ([f"{dev / 1e3:.3f}"] if device else []))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    # The names left-aligned, the numbers right-aligned.
    lines = ("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows)
    return "\n".join(line.rstrip() for line in lines)
