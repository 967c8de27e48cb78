"""The machine: its table as data, the runner, its drawing and the record of a run.

The modules: ``table`` (the transitions, pure data), ``runner``, ``diagram`` (Mermaid, DOT, and SVG
drawn in Python by ``svg``) and ``trace``.
"""

from trainloop.machine.diagram import draw
from trainloop.machine.runner import Handle, StateMachine
from trainloop.machine.table import TRANSITIONS, State, Transition
from trainloop.machine.trace import (
    Trace,
    TraceEntry,
    TraceSummary,
    read_compile_marks,
    read_skipped_updates,
    read_trace,
    summarize_trace,
)

__all__ = [
    "TRANSITIONS",
    "Handle",
    "State",
    "StateMachine",
    "Trace",
    "TraceEntry",
    "TraceSummary",
    "Transition",
    "draw",
    "read_compile_marks",
    "read_skipped_updates",
    "read_trace",
    "summarize_trace",
]
