"""The ``trainloop`` command line: run, validate, schema, graph, inspect, report.

::

    trainloop run run.yaml [--trainer train:MyTrainer] [--set max_steps=100 ...]
    trainloop validate run.yaml [--trainer train:MyTrainer] [--set ...]
    trainloop schema [--trainer train:MyTrainer] [--output schema.json]
    trainloop graph [--format mermaid|dot|svg|png] [--trace runs/exp1] [--output machine.svg]
    trainloop inspect runs/exp1/checkpoints
    trainloop report runs/exp1 [--output report.html]
    trainloop export runs/exp1/checkpoints --output model.safetensors [--weights ema]

``run`` and ``validate`` take the trainer from ``--trainer`` or else the settings' ``trainer`` key.

Exit codes: 0 success; 1 a file cannot be used (a missing or corrupt checkpoint or trace, no
Graphviz); 2 a usage error (invalid settings, a preflight problem, a trainer that cannot be
used, bad arguments), one line per problem, before anything is written; a run that ends on an
exit signal exits with the code its hook chose (128+signal).
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from trainloop.checkpoint import MANIFEST, METADATA, CheckpointError, latest_checkpoint
from trainloop.checkpoint.describe import describe_checkpoint, format_checkpoint, jsonable
from trainloop.checkpoint.loading import SHARDED_DIR
from trainloop.cli import export as export_command
from trainloop.machine.diagram import draw
from trainloop.machine.table import TRANSITIONS, State
from trainloop.machine.trace import TraceSummary, read_trace, summarize_trace
from trainloop.report.graphviz import GraphvizError, find_dot, render_dot
from trainloop.settings.model import SettingsFileError, TrainerSettings
from trainloop.settings.preflight import preflight
from trainloop.settings.sources import read_settings_input
from trainloop.trainer import BaseTrainer

__all__ = ["CliError", "describe_checkpoint", "load_trainer_class", "main"]

PROG = "trainloop"
USAGE_ERROR = 2
FAILURE = 1
_GRAPHVIZ_HINT = (
    "install Graphviz (`apt-get install graphviz`, `conda install graphviz` or `brew install graphviz`) "
    "or use --format mermaid / --format dot, which need no binary"
)


class CliError(Exception):
    """An error the command line reports as one message and an exit code, without a traceback.

    Args:
        message: What went wrong, naming the file, field or argument.
        exit_code: The process's exit code (2: usage, 1: a file cannot be used).
    """

    def __init__(self, message: str, exit_code: int = USAGE_ERROR) -> None:
        super().__init__(message)
        self.exit_code = exit_code


# -- shared pieces -------------------------------------------------------------------------------


def load_trainer_class(spec: str, given_as: str = "--trainer") -> type[BaseTrainer]:
    """Import the trainer class named ``module:Class`` (``Class`` may be dotted: ``Outer.Inner``).

    The working directory is importable, so ``train:MyTrainer`` finds ``./train.py`` whether
    the command runs as ``trainloop`` or ``python -m trainloop``.

    Args:
        spec: ``"package.module:ClassName"``.
        given_as: Where the spec came from, for messages (``--trainer``, ``run.yaml: trainer``).

    Raises:
        CliError: The spec is malformed, the module does not import, the attribute is missing, or
            it is not a ``BaseTrainer`` subclass.
    """
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name.strip() or not attribute.strip():
        raise CliError(f"{given_as} {spec!r}: expected module:Class (e.g. my_project.train:MyTrainer)")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name is not None and (module_name == error.name or module_name.startswith(error.name + ".")):
            raise CliError(f"{given_as} {spec!r}: no module named {error.name!r}") from None
        raise CliError(f"{given_as} {spec!r}: importing {module_name!r} failed: {error}") from None
    except Exception as error:  # noqa: BLE001 - the module's own code failed: say what, in one line
        message = " ".join(f"{type(error).__name__}: {error}".split())
        raise CliError(f"{given_as} {spec!r}: importing {module_name!r} failed: {message}") from None
    for part in attribute.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise CliError(f"{given_as} {spec!r}: {module_name!r} has no attribute {attribute!r}") from None
    if not isinstance(obj, type) or not issubclass(obj, BaseTrainer):
        raise CliError(f"{given_as} {spec!r}: {attribute} is not a subclass of trainloop.BaseTrainer")
    if obj is BaseTrainer:
        raise CliError(f"{given_as} {spec!r}: name your BaseTrainer subclass, not BaseTrainer itself")
    return obj


def _settings_class_for(trainer_spec: str | None) -> type[TrainerSettings]:
    """The settings class to validate with: the trainer's ``settings_class``, or the base one."""
    if trainer_spec is None:
        return TrainerSettings
    return load_trainer_class(trainer_spec).settings_class


def _checked_settings(args: argparse.Namespace, trainer_required: bool) -> tuple[TrainerSettings, type[BaseTrainer] | None]:
    """Resolve, validate and preflight the settings ``args`` name, with the trainer they name.

    The layers are defaults < the file < ``TRAINLOOP_*`` environment < ``--set``. The trainer
    is ``--trainer``, else the settings' ``trainer`` key; its ``settings_class`` validates them,
    and ``trainloop.settings.preflight`` checks them against it. Nothing is built or written.

    Raises:
        CliError: Any problem, one line each, naming the file, variable or override and field.
    """
    try:
        found = read_settings_input(args.settings_file, os.environ, args.set)
    except SettingsFileError as error:
        raise CliError(str(error)) from None
    spec, given_as = args.trainer, "--trainer"
    if spec is not None:
        found.set(["trainer"], spec, f"--trainer {spec}")  # recorded: settings.json says what ran
    elif isinstance(found.data.get("trainer"), str):
        spec = found.data["trainer"]
        given_as = f"{found.source_of(('trainer',))}: trainer"
    no_trainer = CliError(
        f"{args.settings_file}: no trainer to run: give --trainer MODULE:CLASS or a \"trainer\" key in the settings"
    )
    if spec is None and trainer_required and found.data.get("trainer") is None:
        raise no_trainer
    trainer_class = load_trainer_class(spec, given_as) if spec is not None else None
    settings_class = trainer_class.settings_class if trainer_class is not None else TrainerSettings
    try:
        settings = settings_class.validate_input(found)  # also reports a "trainer" that is not a name
    except SettingsFileError as error:
        raise CliError(str(error)) from None
    if trainer_class is None and trainer_required:
        raise no_trainer
    problems = preflight(settings, trainer_class, source_of=found.source_of)
    if problems:
        raise CliError("\n".join(problems))
    return settings, trainer_class


def _configure_logging(level: str) -> None:
    """Send log records to stderr at ``level`` unless the user's code configured logging."""
    if logging.getLogger().handlers or logging.getLogger("trainloop").handlers:
        return
    logging.basicConfig(
        level=level.upper(), stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


def _write_output(output: str | None, data: str | bytes) -> None:
    """Write to ``output`` if given, else to stdout (bytes: to its binary buffer)."""
    if output is not None:
        try:
            if isinstance(data, bytes):
                Path(output).write_bytes(data)
            else:
                Path(output).write_text(data, encoding="utf-8")
        except OSError as error:
            raise CliError(f"{output}: cannot write: {error.strerror}", FAILURE) from None
        return
    if isinstance(data, bytes):
        sys.stdout.flush()
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()
    else:
        sys.stdout.write(data)


# -- run -----------------------------------------------------------------------------------------


def _cmd_run(args: argparse.Namespace) -> int:
    """``trainloop run``: validate and preflight the settings with the trainer's class, then train."""
    settings, trainer_class = _checked_settings(args, trainer_required=True)
    assert trainer_class is not None  # required above
    _configure_logging(args.log_level)
    try:
        # A signal exit raises SystemExit(code) from train(): it propagates as the exit code.
        trainer_class(settings).train()
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT
    return 0


# -- validate ------------------------------------------------------------------------------------


def _cmd_validate(args: argparse.Namespace) -> int:
    """``trainloop validate``: the checks of ``run``, then print the resolved settings as JSON;
    builds and writes nothing."""
    settings, _ = _checked_settings(args, trainer_required=False)
    sys.stdout.write(settings.model_dump_json(indent=2) + "\n")
    return 0


# -- schema --------------------------------------------------------------------------------------


def _schema_text(cls: type[TrainerSettings]) -> str:
    """The JSON Schema of ``cls`` as ``schemas/trainer_settings.schema.json`` holds it."""
    return json.dumps(cls.json_schema(), indent=2) + "\n"


def _cmd_schema(args: argparse.Namespace) -> int:
    """``trainloop schema``: print or write the settings' JSON Schema."""
    _write_output(args.output, _schema_text(_settings_class_for(args.trainer)))
    return 0


# -- graph ---------------------------------------------------------------------------------------


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
    """A short, human summary of a trace: steps, rare events, and time per state."""
    total = sum(summary.seconds_in_state.values())
    fired = sum(summary.counts.values())
    retries = sum(n for (_, dest, _), n in summary.counts.items() if dest is State.RETRYING)
    saves = sum(n for (_, dest, _), n in summary.counts.items() if dest is State.CHECKPOINTING)
    failures = [source.value for (source, _, trigger), n in summary.counts.items() if trigger == "fail" and n]
    runs_text = f" in {summary.runs} runs" if summary.runs > 1 else ""
    lines = [
        f"{path}: {summary.steps} steps{runs_text}, {fired} transitions, {total:.3f} s traced; "
        f"retries: {retries}, checkpoints: {saves}"
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
        raise CliError(f"--format {format} needs Graphviz's `dot` program, which is not on PATH: {_GRAPHVIZ_HINT}", FAILURE) from None


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


def _cmd_graph(args: argparse.Namespace) -> int:
    """``trainloop graph``: draw the machine, optionally weighted by a run's trace."""
    binary = args.format in ("svg", "png")
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
    source = draw(TRANSITIONS, "mermaid" if args.format == "mermaid" else "dot", counts=counts)
    _write_output(args.output, _render_with_dot(source, args.format) if binary else source)
    return 0


# -- inspect -------------------------------------------------------------------------------------


def _is_checkpoint(directory: Path) -> bool:
    """Whether ``directory`` looks like one checkpoint (rather than a root of several)."""
    return (
        any(directory.glob("*.pt"))
        or any((directory / name).exists() for name in (MANIFEST, METADATA, SHARDED_DIR))
    )


def _find_checkpoint(path: str) -> tuple[Path, Path | None]:
    """The checkpoint directory ``path`` names: itself, or the latest under a checkpoints root
    (or under ``<workspace>/checkpoints``).

    Returns:
        The checkpoint directory, and the root it was found under (``None`` if given directly).

    Raises:
        CliError: Nothing there is a checkpoint.
    """
    given = Path(path)
    if not given.exists():
        raise CliError(f"{given}: no such file or directory", FAILURE)
    if not given.is_dir():
        raise CliError(f"{given}: not a directory (give a checkpoint directory or a checkpoints root)", FAILURE)
    if _is_checkpoint(given):
        return given, None
    for root in (given, given / "checkpoints"):
        # Unverified: the one `latest` names is the one to report on, intact or not.
        found = latest_checkpoint(root, verify=False)
        if found is not None:
            return found, root
    leftovers = sorted(p.name for p in given.iterdir() if p.name.startswith(".") and "-" in p.name)
    hint = f" (only an interrupted save's leftovers: {', '.join(leftovers)})" if leftovers else ""
    raise CliError(f"{given}: no checkpoint here: no checkpoint files and no complete step directory{hint}", FAILURE)


def _intact_alternative(root: Path, broken: Path) -> str:
    """Which checkpoint under ``root`` a resume would use instead of the broken one, as a hint."""
    quiet = logging.getLogger("trainloop.cli.main.quiet")  # the skipped ones are reported already
    if not quiet.handlers:
        quiet.addHandler(logging.NullHandler())
        quiet.propagate = False
    found = latest_checkpoint(root, verify=True, logger=quiet)
    if found is None:
        return f"; no checkpoint under {root} is intact"
    if found.resolve() == broken.resolve():
        return ""
    return f"; the newest intact checkpoint under {root} is {found}, which a resume from \"latest\" loads"


def _cmd_inspect(args: argparse.Namespace) -> int:
    """``trainloop inspect``: report what a checkpoint holds, or why it cannot be read."""
    directory, root = _find_checkpoint(args.checkpoint)
    try:
        info = describe_checkpoint(directory)
    except CheckpointError as error:
        hint = _intact_alternative(root, directory) if root is not None else ""
        raise CliError(f"{error}{hint}", FAILURE) from None
    sys.stdout.write(json.dumps(info, indent=2, default=jsonable) + "\n" if args.json else format_checkpoint(info, root))
    return 0


# -- report --------------------------------------------------------------------------------------


def _cmd_report(args: argparse.Namespace) -> int:
    """``trainloop report``: write a run's self-contained HTML report page."""
    from trainloop.report.page import ReportError, write_report  # matplotlib is imported only for a report

    try:
        target = write_report(args.workspace, args.output)
    except ReportError as error:
        raise CliError(str(error), FAILURE) from None
    except OSError as error:
        raise CliError(f"{error.filename}: cannot write: {error.strerror}", FAILURE) from None
    print(f"{PROG} report: wrote {target}", file=sys.stderr)
    return 0


# -- the parser ----------------------------------------------------------------------------------


def _build_parser() -> argparse.ArgumentParser:
    """The ``trainloop`` argument parser and its subcommands."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Run, check and look into trainloop training runs.",
        epilog="Exit codes: 0 ok, 1 a file cannot be used, 2 usage or settings error, 128+N a signal exit.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def settings_args(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("settings_file", metavar="SETTINGS_FILE", help="a .json, .yaml/.yml or .toml settings file")
        sub.add_argument(
            "--trainer", metavar="MODULE:CLASS",
            help="the BaseTrainer subclass (its settings_class validates the settings); default: the settings' trainer key",
        )
        sub.add_argument(
            "--set", action="append", default=[], metavar="KEY=VALUE",
            help="override a setting (repeatable; nested: optimizer.lr=0.1, hooks.0.interval=5 or "
            "hooks.checkpointing.interval=5); values are JSON or plain text",
        )

    run = commands.add_parser(
        "run", help="validate the settings and train",
        description="Validate the settings (file < TRAINLOOP_* environment < --set), check them with the "
        "trainer (the preflight), then train. A problem exits 2 before anything is written.",
    )
    settings_args(run)
    run.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"],
        help="log level on stderr, unless the trainer's module configured logging (default: info)",
    )
    run.set_defaults(handler=_cmd_run)

    validate = commands.add_parser(
        "validate", help="print the resolved settings, or what is wrong with them",
        description="Resolve and validate the settings, run the preflight that `run` runs (with the trainer, "
        "if one is named), and print the settings as JSON; builds and writes nothing.",
    )
    settings_args(validate)
    validate.set_defaults(handler=_cmd_validate)

    schema = commands.add_parser("schema", help="print the settings' JSON Schema", description="Print or write the settings' JSON Schema.")
    schema.add_argument("--output", metavar="PATH", help="write it here instead of stdout")
    schema.add_argument("--trainer", metavar="MODULE:CLASS", help="the schema of this trainer's settings_class")
    schema.set_defaults(handler=_cmd_schema)

    graph = commands.add_parser(
        "graph", help="draw the state machine",
        description="Draw the state machine; with --trace, weight each edge by how often it fired in a run.",
    )
    graph.add_argument("--format", default="mermaid", choices=["mermaid", "dot", "svg", "png"],
                       help="mermaid or dot source text, or svg/png rendered by Graphviz's dot (default: mermaid)")
    graph.add_argument("--trace", metavar="WORKSPACE_OR_TRACE_FILE", help="a run's workspace or its trace.jsonl")
    graph.add_argument("--output", metavar="PATH", help="write it here instead of stdout")
    graph.set_defaults(handler=_cmd_graph)

    inspect = commands.add_parser(
        "inspect", help="show what a checkpoint holds",
        description="Show what a checkpoint holds. Give a checkpoint directory, a checkpoints root "
        "(its latest is shown) or a workspace with a checkpoints/ directory.",
    )
    inspect.add_argument("checkpoint", metavar="CHECKPOINT_DIR")
    inspect.add_argument("--json", action="store_true", help="print the report as JSON")
    inspect.set_defaults(handler=_cmd_inspect)

    report = commands.add_parser(
        "report", help="write a run's report page (HTML)",
        description="Write one self-contained HTML page about a run: settings, metric curves, the machine "
        "weighted by its trace, time per state, runs, checkpoints (best marked).",
    )
    report.add_argument("workspace", metavar="WORKSPACE", help="the run's workspace directory")
    report.add_argument("--output", metavar="PATH", help="where to write it (default: WORKSPACE/report.html)")
    report.set_defaults(handler=_cmd_report)
    export_command.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``trainloop`` command line.

    Args:
        argv: The arguments (without the program name); ``sys.argv[1:]`` when ``None``.

    Returns:
        The exit code. A run ended by an exit signal raises ``SystemExit`` with its code instead.
    """
    args = _build_parser().parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except CliError as error:
        for line in str(error).splitlines():  # one line per problem, each saying which command
            print(f"{PROG} {args.command}: error: {line}", file=sys.stderr)
        return error.exit_code


if __name__ == "__main__":
    sys.exit(main())
