"""``ProfilerHook``: ``torch.profiler`` over a declared window of steps, each machine state a named range."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import validate_call
from torch.profiler import ProfilerAction, ProfilerActivity, profile, record_function, schedule

from trainloop.core.workspace import declared_output_problems, path_problem
from trainloop.distributed.ranks import is_rank_zero, rank
from trainloop.hook_machinery.base import BaseHook
from trainloop.hook_machinery.checks import HookProblem, listed, needs_workspace, one_process
from trainloop.hook_machinery.registry import register_hook
from trainloop.hooks.profiler_table import RANGE_PREFIX, ops_per_state
from trainloop.settings.types import NonEmptyPath, NonNegativeInt, PositiveInt, StrictBool

if TYPE_CHECKING:
    from trainloop.core.run_state import TrainerView
    from trainloop.machine.runner import Handle
    from trainloop.machine.table import Transition

__all__ = ["ProfilerHook"]

#: The table's action on the edges that begin a new step (``Transition.action``): a profiler step begins there.
_NEW_STEP = "begin_step"
_RECORDING = (ProfilerAction.RECORD, ProfilerAction.RECORD_AND_SAVE)
#: The traces' folder under the workspace when no ``trace_dir`` is given.
_DEFAULT_DIR = "profiles"


@register_hook("profiler")
class ProfilerHook(BaseHook):
    """Profile a window of steps with ``torch.profiler``, every machine state a named range in the trace.

    The window is ``torch.profiler.schedule(wait, warmup, active, repeat)``, counted in steps from
    the first step this run trains (a resumed run counts from where it resumed): ``wait`` steps
    not profiled, ``warmup`` steps profiled and thrown away (the profiler's own start-up cost lands
    there), then ``active`` steps recorded; that cycle ``repeat`` times (``0``: until the run ends).
    A profiler step is one optimizer step: it begins on the edge that begins a step, so a retried
    step stays one step.

    While the profiler runs, the work of each state the machine enters (``accumulating``,
    ``stepping``, ``checkpointing``, any state) is a ``record_function`` range named
    ``trainloop/<state>``: opened as the edge into the state fires, before the edge's action and
    the state's entry callbacks, and closed when the next edge fires, so a range holds what the
    trace counts as that state's time. When the last window is written the hook detaches from the
    machine and the profiler stops: the rest of the run pays nothing for it.

    Each active window is written by every rank to ``<trace_dir>/rank<r>.<step>.pt.trace.json``
    (``<step>``: the window's last step), a Chrome trace that Perfetto, ``chrome://tracing`` and
    TensorBoard's profiler plugin open. Rank 0 logs, per state, its time and its top operators by
    self CPU time (and device time when there is any).

    Args:
        wait: Steps skipped at the start of each cycle.
        warmup: Steps profiled but discarded before the active ones, ``0`` or more.
        active: Steps recorded per cycle, ``>= 1``.
        repeat: Cycles; ``0`` repeats them until the run ends.
        record_shapes: Record the operators' input shapes.
        profile_memory: Record tensor memory allocation and release.
        with_stack: Record the Python stack of each operator (slow; larger traces).
        trace_dir: Folder of the traces. ``None``: ``<workspace>/profiles``; a relative path is
            taken under the workspace, an absolute one as it is.
        top: Operators listed per state in the log (``0``: no table).

    Raises:
        pydantic.ValidationError: A parameter is invalid; the error names it.
    """

    @classmethod
    def check_settings(cls, declared: Any, settings: Any, trainer: Any) -> list[HookProblem]:
        """Traces under a workspace need one, their folder can be made and written, the first window fits the run."""
        given = declared.trace_dir
        where = f"{str(given)!r}, a relative path" if given is not None else "<workspace>/profiles"
        problems = needs_workspace(settings, given, "trace_dir", f"traces go to {where}")
        problems += declared_output_problems(settings, given if given is not None else Path(_DEFAULT_DIR), "trace_dir")
        first = declared.wait + declared.warmup + declared.active
        if settings.max_steps is not None and first > settings.max_steps:
            problems.append(
                (None, f"its first window ends at step {first} (wait + warmup + active) but max_steps is "
                       f"{settings.max_steps}: the run would end before the profile is complete")
            )
        return problems

    @classmethod
    def check_together(cls, declared: Sequence[tuple[int, Any]], settings: Any) -> list[str]:
        """One profiler per run: ``torch.profiler`` runs one at a time."""
        if len(declared) > 1:
            return [f"{listed(i for i, _ in declared)}: torch runs one profiler at a time; declare one profiler hook"]
        return []

    @validate_call
    def __init__(
        self,
        wait: NonNegativeInt = 1,
        warmup: NonNegativeInt = 1,
        active: PositiveInt = 3,
        repeat: NonNegativeInt = 1,
        record_shapes: StrictBool = False,
        profile_memory: StrictBool = False,
        with_stack: StrictBool = False,
        trace_dir: NonEmptyPath | None = None,
        top: NonNegativeInt = 5,
    ) -> None:
        self.wait, self.warmup, self.active, self.repeat = wait, warmup, active, repeat
        self.record_shapes, self.profile_memory, self.with_stack = record_shapes, profile_memory, with_stack
        self.trace_dir = trace_dir
        self.top = top
        self.traces: list[Path] = []
        """The trace files this hook wrote, in order."""
        self._profiler: profile | None = None
        self._edges: Handle | None = None
        self._range: record_function | None = None
        self._directory = Path()
        self._recording_from: int | None = None  # the first step of the window being recorded
        self._first_step = 0  # the step the run started from

    def on_before_train(self, trainer: TrainerView) -> None:
        """Resolve the trace folder and follow the machine's edges; the profiler starts with the first step.

        Raises:
            ValueError: The trace folder cannot be made or written (said before the first step,
                not after the window: the preflight says it of a hook declared in settings).
        """
        self.traces = []
        self._directory = self._resolve_trace_dir(trainer)
        problem = path_problem(self._directory) if one_process() else None
        if problem is not None:
            raise ValueError(f"{type(self).__name__} {self.name!r} trace_dir: {problem}")
        self._first_step = trainer.step
        self._edges = trainer.on_edge(self._on_edge)

    def on_after_train(self, trainer: TrainerView) -> None:
        """Stop a profiler still running (a window the run ended in is written), and detach.

        A run that trained steps but ended before the first active one says so (one line on the
        logger); a run that trained nothing (resumed complete) had nothing to profile.
        """
        self._stop()
        if not self.traces and trainer.error is None and trainer.step > self._first_step:
            trainer.logger.warning(
                "%s %r wrote no trace: the run ended before its first active step (wait=%d, warmup=%d)",
                type(self).__name__, self.name, self.wait, self.warmup,
            )

    def _resolve_trace_dir(self, trainer: TrainerView) -> Path:
        if self.trace_dir is not None and self.trace_dir.is_absolute():
            return self.trace_dir
        if trainer.workspace is None:
            raise ValueError(
                f"{type(self).__name__} {self.name!r} writes traces to "
                f"<workspace>/{self.trace_dir or _DEFAULT_DIR}, but the trainer's `workspace` setting is None; "
                "set workspace=... or give the hook an absolute trace_dir"
            )
        return trainer.workspace / (self.trace_dir or _DEFAULT_DIR)

    def _on_edge(self, trainer: TrainerView, transition: Transition) -> None:
        """Close the range of the state left, step the profiler if a step begins, open the entered state's range."""
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
        if transition.action == _NEW_STEP and not self._step(trainer):
            return
        if self._profiler is not None:
            self._range = record_function(RANGE_PREFIX + transition.dest.value)
            self._range.__enter__()  # type: ignore[no-untyped-call]  # unannotated in torch

    def _step(self, trainer: TrainerView) -> bool:
        """Start or step the profiler as step ``trainer.step + 1`` begins; ``False`` once its last window is over."""
        if self._profiler is None:
            self._profiler = self._start(trainer)
        else:
            with warnings.catch_warnings():
                # Said when a second cycle begins: each cycle is written by itself, as meant here.
                warnings.filterwarnings("ignore", "Warning: Profiler clears events at the end of each cycle")
                self._profiler.step()  # may write a window (on_trace_ready)
        if self._profiler.current_action in _RECORDING and self._recording_from is None:
            self._recording_from = trainer.step + 1
        if self.repeat and self._profiler.step_num >= (self.wait + self.warmup + self.active) * self.repeat:
            self._stop()
            return False
        return True

    def _start(self, trainer: TrainerView) -> profile:
        activities = [ProfilerActivity.CPU]
        if trainer.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        profiler = profile(
            activities=activities,
            schedule=schedule(wait=self.wait, warmup=self.warmup, active=self.active, repeat=self.repeat),
            on_trace_ready=functools.partial(self._write, trainer),
            record_shapes=self.record_shapes,
            profile_memory=self.profile_memory,
            with_stack=self.with_stack,
        )
        profiler.start()
        return profiler

    def _stop(self) -> None:
        """Close the open range, stop the profiler (writing a window being recorded) and detach from the machine."""
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
        if self._edges is not None:
            self._edges.remove()
            self._edges = None
        if self._profiler is not None:
            profiler, self._profiler = self._profiler, None
            profiler.stop()

    def _write(self, trainer: TrainerView, profiler: profile) -> None:
        """Write the window's trace (every rank), and log its top operators per state (rank 0)."""
        step, first = trainer.step, self._recording_from
        self._recording_from = None
        self._directory.mkdir(parents=True, exist_ok=True)
        path = self._directory / f"rank{rank()}.{step}.pt.trace.json"
        profiler.export_chrome_trace(str(path))
        self.traces.append(path)
        if is_rank_zero():
            events = profiler.events()  # type: ignore[no-untyped-call]  # unannotated in torch
            table = ops_per_state(events, self.top) if self.top else ""
            trainer.logger.info(
                "Profiled steps %s-%d into %s%s", first if first is not None else "?", step, path,
                "; per state, its time and top operators:\n" + table if table else "",
            )

