"""``trainloop graph``.

Draw the state machine, optionally weighted by a run's trace, optionally with the hooks a settings file declares beside
the states they act in.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from trainloop.cli.errors import FAILURE, CliError
from trainloop.cli.output import write_output
from trainloop.cli.trainer_class import load_trainer_class
from trainloop.machine.diagram import draw
from trainloop.machine.table import TRANSITIONS, State
from trainloop.machine.trace import TraceSummary, read_trace, summarize_trace
from trainloop.report.graphviz import GraphvizError, find_dot, render_dot
from trainloop.settings.model import TrainerSettings
from trainloop.settings.sources import SettingsFileError, read_settings_input

__all__ = ["command"]

_GRAPHVIZ_HINT = (
    "install Graphviz (`apt-get install graphviz`, `conda install graphviz` or `brew install graphviz`) "
    "or use --format mermaid / --format dot, which need no binary"
)


def command(args: argparse.Namespace) -> int:
    """Write the machine as ``args.format``; with ``--trace``, each edge's count and a summary."""
    binary = args.format == "png"  # svg is drawn in Python (trainloop.machine.svg); png needs Graphviz
    if binary:
        _find_dot(args.format)  # before reading anything: fail fast
    if args.format == "png" and args.output is None and sys.stdout.isatty():
        raise CliError("--format png writes binary data: give --output PATH or redirect stdout")
    counts = None
    if args.trace is not None:
        path = _trace_file(args.trace)
        try:
            entries = read_trace(path)
        except (OSError, ValueError) as error:
            raise CliError(str(error), FAILURE) from None
        summary = summarize_trace(entries)
        counts = summary.counts
        sys.stderr.write(_describe_trace(path, summary))
    notes = _hook_notes(args.settings, args.trainer) if args.settings is not None else None
    source = draw(TRANSITIONS, "dot" if binary else args.format, counts=counts, notes=notes)
    write_output(args.output, _render_with_dot(source, args.format) if binary else source)
    return 0


def _hook_notes(settings_file: str, trainer_spec: str | None) -> dict[State, list[str]]:
    """The hooks a settings file declares, by the state each acts in, with their schedules.

    The file is read as ``run`` reads it (with the ``TRAINLOOP_*`` environment) and validated by
    the trainer's ``settings_class`` (``--trainer``, else the file's ``trainer`` key; importing
    it registers its hook types); no preflight: drawing runs nothing.

    Raises:
        CliError: The file cannot be read or does not validate, or the trainer cannot be used.
    """
    from trainloop.hook_machinery.listing import declared_hook_lines, hook_line, hook_notes
    from trainloop.hook_machinery.registry import with_default_hooks

    try:
        found = read_settings_input(settings_file, os.environ, [])
    except SettingsFileError as error:
        raise CliError(str(error)) from None
    spec, given_as = trainer_spec, "--trainer"
    if spec is None and isinstance(found.data.get("trainer"), str):
        spec, given_as = found.data["trainer"], f"{found.source_of(('trainer',))}: trainer"
    settings_class = load_trainer_class(spec, given_as).settings_class if spec is not None else TrainerSettings
    try:
        settings = settings_class.validate_input(found)
    except SettingsFileError as error:
        raise CliError(str(error)) from None
    lines = declared_hook_lines(settings.hooks)
    # The hooks a run adds by itself (a LoggingHook: a workspace with metrics.jsonl, nothing declared logs) act too.
    declared = [entry.build() for entry in settings.hooks]
    added = with_default_hooks(declared, settings)[: -len(declared) or None]
    for hook in reversed(added):
        lines.insert(0, hook_line(hook, f"{getattr(type(hook), 'hook_type', hook.name)} (added by default)"))
    return hook_notes(lines)


def _trace_file(path: str) -> Path:
    """``path`` if it is a trace file, ``path/trace.jsonl`` if it is a workspace.

    Raises:
        CliError: There is no trace there.
    """
    candidate = Path(path)
    if candidate.is_dir():
        candidate = candidate / "trace.jsonl"
    if not candidate.is_file():
        raise CliError(
            f"{candidate}: no trace file (a run records one in its workspace when its settings have "
            "\"trace\": true)",
            FAILURE,
        )
    return candidate


def _describe_trace(path: Path, summary: TraceSummary) -> str:
    """A short, human summary of a trace: steps, rare events (validations too), and time per state."""
    total = sum(summary.seconds_in_state.values())
    fired = sum(summary.counts.values())
    retries = sum(n for (_, dest, _), n in summary.counts.items() if dest is State.RETRYING)
    saves = sum(n for (_, dest, _), n in summary.counts.items() if dest is State.CHECKPOINTING)
    validations = sum(n for (_, dest, _), n in summary.counts.items() if dest is State.VALIDATING)
    failures = [source.value for (source, _, trigger), n in summary.counts.items() if trigger == "fail" and n]
    runs_text = f" in {summary.runs} runs" if summary.runs > 1 else ""
    lines = [
        f"{path}: {summary.steps} steps{runs_text}, {fired} transitions, {total:.3f} s traced; "
        f"retries: {retries}, checkpoints: {saves}, validations: {validations}"
        + (f"; ended by an error in {', '.join(failures)}" if failures else "")
    ]
    for state, seconds in sorted(summary.seconds_in_state.items(), key=lambda item: -item[1]):
        share = 100.0 * seconds / total if total > 0 else 0.0
        lines.append(f"  {state.value:<14} {seconds:10.3f} s {share:6.1f}%")
    return "\n".join(lines) + "\n"


def _find_dot(format: str) -> str:
    """The path of Graphviz's ``dot`` program.

    Raises:
        CliError: It is not on ``PATH``; the message says how to install it.
    """
    try:
        return find_dot()
    except GraphvizError:
        raise CliError(
            f"--format {format} needs Graphviz's `dot` program, which is not on PATH: {_GRAPHVIZ_HINT}", FAILURE
        ) from None


def _render_with_dot(source: str, format: str) -> bytes:
    """Run Graphviz's ``dot`` on DOT ``source``.

    Raises:
        CliError: ``dot`` is not installed, or it failed.
    """
    _find_dot(format)
    try:
        return render_dot(source, format)
    except GraphvizError as error:
        raise CliError(str(error), FAILURE) from None
