"""Which steps ``torch.compile`` spent compiling, and why it recompiled.

The loop asks a ``CompileWatch`` at the start and the end of every step whether
``torch._dynamo`` compiled a frame in between. The question costs a module lookup and, once
dynamo is loaded, a counter read: no host sync, no torch call. Only a step that did compile asks
dynamo what it compiled (``torch._dynamo.utils.get_compilation_metrics()``), for the reason of a
recompilation (the guard that failed, as ``TORCH_LOGS=recompiles`` would show it).

A run that never compiles never imports ``torch._dynamo`` here: while it is not loaded, nothing
can have been compiled.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Protocol

from trainloop.machine.trace import CompileMark

if TYPE_CHECKING:
    from logging import Logger

    from trainloop.step_info import StepInfo

__all__ = ["CompileWatch", "note_compiled"]

_DYNAMO_UTILS = "torch._dynamo.utils"



class CompileWatch:
    """Tells, at the end of a step, whether ``torch.compile`` compiled during it.

    Attributes:
        marks: Every step that compiled, in order.
    """

    def __init__(self) -> None:
        self.marks: list[CompileMark] = []
        self._frames = 0
        self._counters: Any = None  # dynamo's counters, once it is loaded
        self._seen: Any = None  # the newest compilation record already accounted for

    @property
    def recompilations(self) -> int:
        """How many steps recompiled a frame."""
        return sum(mark.recompilation for mark in self.marks)

    def frames_compiled(self) -> int:
        """How many frames dynamo has tried to compile so far in this process (0 while it is not loaded)."""
        counters = self._counters
        if counters is None:
            utils = sys.modules.get(_DYNAMO_UTILS)
            if utils is None:
                return 0
            self._counters = counters = utils.counters  # one object for the process (reset clears it)
        total: int = counters["frames"]["total"]
        return total

    def begin(self) -> None:
        """Note dynamo's frame count at the start of a step."""
        self._frames = self.frames_compiled()

    def end(self, step: int, seconds: float) -> CompileMark | None:
        """The step's ``CompileMark`` if dynamo compiled since ``begin``, else ``None``."""
        frames = self.frames_compiled() - self._frames
        if frames <= 0:  # nothing compiled (or torch._dynamo.reset() cleared the counters)
            return None
        reasons = tuple(reason for reason in self._new_records_reasons() if reason)
        mark = CompileMark(step, seconds, frames, recompilation=bool(reasons), reasons=reasons)
        self.marks.append(mark)
        return mark

    def _new_records_reasons(self) -> list[str | None]:
        """The ``recompile_reason`` of each compilation dynamo recorded since the last call."""
        records = sys.modules[_DYNAMO_UTILS].get_compilation_metrics()
        new = records
        for i in range(len(records) - 1, -1, -1):
            if records[i] is self._seen:
                new = records[i + 1 :]
                break
        if records:
            self._seen = records[-1]
        return [getattr(record, "recompile_reason", None) for record in new]


class _MarksCompiled(Protocol):
    """A record of the run that marks compiling steps (a ``trainloop.machine.trace.Trace``)."""

    def mark_compiled(self, mark: CompileMark) -> None:
        """Mark ``mark.step`` as a step ``torch.compile`` spent compiling."""


def note_compiled(mark: CompileMark, step_info: StepInfo, trace: _MarksCompiled | None, logger: Logger) -> None:
    """Mark a step that ran torch.compile's compiler: in its step info, the trace and the log (once each)."""
    step_info.compiled = mark
    if trace is not None:
        trace.mark_compiled(mark)
    log = logger.warning if mark.recompilation else logger.info
    log("%s", mark.describe())
