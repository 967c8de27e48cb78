"""The ``trainloop`` command line: run, evaluate, predict, validate, schema, graph, inspect, report, export.

::

    trainloop run run.yaml [--trainer train:MyTrainer] [--set max_steps=100 ...]
    trainloop evaluate run.yaml [--checkpoint latest|DIR|none] [--weights ema] [--trainer ...] [--set ...]
    trainloop predict run.yaml [--checkpoint latest|DIR|none] [--weights ema] [--output preds.pt]
    trainloop validate run.yaml [--trainer train:MyTrainer] [--set ...]
    trainloop schema [--trainer train:MyTrainer] [--output schema.json]
    trainloop graph [--format mermaid|dot|svg|png] [--trace runs/exp1]
                    [--settings run.yaml [--trainer train:MyTrainer]] [--output machine.svg]
    trainloop inspect runs/exp1/checkpoints
    trainloop report runs/exp1 [--output report.html]
    trainloop export runs/exp1/checkpoints --output model.safetensors [--weights ema]

``run``, ``evaluate``, ``predict`` and ``validate`` take the trainer from ``--trainer`` or else the
settings' ``trainer`` key.

Exit codes: 0 success; 1 a file cannot be used (a missing or corrupt checkpoint or trace, no
Graphviz); 2 a usage error (invalid settings, a preflight problem, a trainer that cannot be
used, bad arguments), one line per problem, before anything is written; a run that ends on an
exit signal exits with the code its hook chose (128+signal).

This module is the front door: it declares every command's arguments and imports nothing
heavy, so ``--help`` answers at once. Each command is a module of this package
(``trainloop.cli.run``...), imported (with torch) only when that command runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from trainloop.cli.errors import FAILURE, PROG, CliError, storage_failure

__all__ = ["COMMANDS", "CliError", "main"]

COMMANDS = ("run", "evaluate", "predict", "validate", "schema", "graph", "inspect", "report", "export")
"""The subcommands; each is the module ``trainloop.cli.<name>``, whose ``command(args)`` runs it."""


def path_text(text: str) -> str:
    """A path argument as given; an empty one is a usage error (``Path("")`` would be the current directory)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path")
    return text


def _settings_args(sub: argparse.ArgumentParser) -> None:
    """The arguments ``run``, ``evaluate``, ``predict`` and ``validate`` share: the file, the trainer, the overrides."""
    sub.add_argument(
        "settings_file", type=path_text, metavar="SETTINGS_FILE", help="a .json, .yaml/.yml or .toml settings file"
    )
    sub.add_argument(
        "--trainer", metavar="MODULE:CLASS",
        help="the BaseTrainer subclass (its settings_class validates the settings); default: the settings' trainer key",
    )
    sub.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="override a setting (repeatable; nested: optimizer.lr=0.1, hooks.0.interval=5 or "
        "hooks.checkpointing.interval=5); values are JSON or plain text",
    )


def _log_level_arg(sub: argparse.ArgumentParser) -> None:
    sub.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"],
        help="log level on stderr, unless the trainer's module configured logging (default: info)",
    )


def _weights_args(sub: argparse.ArgumentParser, verb: str) -> None:
    """The weights ``evaluate`` and ``predict`` restore: which checkpoint, model or EMA."""
    sub.add_argument(
        "--checkpoint", default="latest", metavar="latest|DIR|none",
        help="latest (default): the run's latest complete checkpoint, an error if there is none; DIR: a checkpoint "
        "directory, full or sharded, or a checkpoints root; none: the model as built (init_from applied)",
    )
    sub.add_argument("--weights", default="model", metavar="WHICH",
                     help=f'"model" (default), "ema", or the name of the EMA hook whose weights to {verb}')


def _smoothing(text: str) -> float:
    """``--smoothing``: a factor in ``[0, 1)`` (the default is ``trainloop.report.page.DEFAULT_SMOOTHING``)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number (give a factor in [0, 1); 0: none)") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"{text} is outside [0, 1) (0: none; 0.6 is TensorBoard's default)")
    return value


def _build_parser() -> argparse.ArgumentParser:
    """The ``trainloop`` argument parser and its subcommands."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Run, check and look into trainloop training runs.",
        epilog="Exit codes: 0 ok, 1 a file cannot be used, 2 usage or settings error, 128+N a signal exit.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = commands.add_parser(
        "run", help="validate the settings and train",
        description="Validate the settings (file < TRAINLOOP_* environment < --set), check them with the "
        "trainer (the preflight), then train. A problem exits 2 before anything is written.",
    )
    _settings_args(run)
    _log_level_arg(run)

    evaluate = commands.add_parser(
        "evaluate", help="run every validation once on a checkpoint's weights; print the metrics as JSON",
        description="Check the settings as `run` does, build the trainer, restore the model's weights (the run's "
        "latest checkpoint by default), run every ValidationHook once and print the metrics as one JSON object on "
        "stdout (logs on stderr). Writes nothing into the checkpoint directory; the path is building -> restoring "
        "-> validating -> exiting.",
    )
    _settings_args(evaluate)
    _weights_args(evaluate, "evaluate")
    _log_level_arg(evaluate)

    predict = commands.add_parser(
        "predict", help="predict every item of the trainer's predict data and write them to one file",
        description="Validate the settings as `run` does, restore the model, run the trainer's predict_step over "
        "build_predict_data_loader()'s data and write every item's outputs once, in dataset order (gathered from "
        "every rank, a DistributedSampler's padding dropped), to one .safetensors or .pt file.",
    )
    _settings_args(predict)
    _weights_args(predict, "use")
    predict.add_argument("--output", "-o", type=path_text, metavar="PATH",
                         help="the .safetensors or .pt file to write (default: WORKSPACE/predictions.safetensors)")
    _log_level_arg(predict)

    validate = commands.add_parser(
        "validate", help="print the resolved settings, or what is wrong with them",
        description="Resolve and validate the settings, run the preflight that `run` runs (with the trainer, "
        "if one is named), and print the settings as JSON; builds and writes nothing.",
    )
    _settings_args(validate)

    schema = commands.add_parser(
        "schema", help="print the settings' JSON Schema", description="Print or write the settings' JSON Schema."
    )
    schema.add_argument("--output", type=path_text, metavar="PATH", help="write it here instead of stdout")
    schema.add_argument("--trainer", metavar="MODULE:CLASS", help="the schema of this trainer's settings_class")

    graph = commands.add_parser(
        "graph", help="draw the state machine",
        description="Draw the state machine; with --trace, weight each edge by how often it fired in a run; "
        "with --settings, note each declared hook beside the state it acts in, with its schedule.",
    )
    graph.add_argument("--format", default="mermaid", choices=["mermaid", "dot", "svg", "png"],
                       help="mermaid or dot source text, svg (drawn without Graphviz) or png (rendered by "
                       "Graphviz's dot); default: mermaid")
    graph.add_argument(
        "--trace", type=path_text, metavar="WORKSPACE_OR_TRACE_FILE", help="a run's workspace or its trace.jsonl"
    )
    graph.add_argument(
        "--settings",
        type=path_text,
        metavar="SETTINGS_FILE",
        help="show the hooks this settings file declares beside the states they act in, with their schedules",
    )
    graph.add_argument(
        "--trainer",
        metavar="MODULE:CLASS",
        help="with --settings: the trainer whose settings_class validates them (default: the settings' trainer key)",
    )
    graph.add_argument("--output", type=path_text, metavar="PATH", help="write it here instead of stdout")

    inspect = commands.add_parser(
        "inspect", help="show what a checkpoint holds",
        description="Show what a checkpoint holds. Give a checkpoint directory, a checkpoints root "
        "(its latest is shown) or a workspace with a checkpoints/ directory.",
    )
    inspect.add_argument("checkpoint", type=path_text, metavar="CHECKPOINT_DIR")
    inspect.add_argument("--json", action="store_true", help="print the report as JSON")

    report = commands.add_parser(
        "report", help="write a run's report page (HTML)",
        description="Write one self-contained HTML page about a run: settings, metric curves, the machine "
        "weighted by its trace, time per state, runs, checkpoints (best marked).",
    )
    report.add_argument("workspace", type=path_text, metavar="WORKSPACE", help="the run's workspace directory")
    report.add_argument(
        "--output", type=path_text, metavar="PATH", help="where to write it (default: WORKSPACE/report.html)"
    )
    report.add_argument(
        "--smoothing", metavar="FACTOR", type=_smoothing, default=0.6,
        help="the charts' exponential moving average, in [0, 1) as TensorBoard's; 0: none (default: 0.6)",
    )
    report.add_argument("--graphviz", action="store_true", help="draw the machine with Graphviz's dot (installed)")

    export = commands.add_parser(
        "export", help="write a checkpoint's weights to one .safetensors file",
        description="Write the model's (or its EMA hook's) weights of a checkpoint, full or sharded, to one "
        ".safetensors file: clean keys, tied weights included, metadata with the step, the settings' hash "
        "and the trainloop version. Give a checkpoint directory, a checkpoints root or a workspace (its latest).",
    )
    export.add_argument("checkpoint", type=path_text, metavar="CHECKPOINT")
    export.add_argument(
        "--output", "-o", type=path_text, required=True, metavar="PATH", help="the .safetensors file to write"
    )
    export.add_argument("--weights", default="model", metavar="WHICH",
                        help='"model" (default), "ema", or the name of the EMA hook whose weights to export')
    assert tuple(commands.choices) == COMMANDS
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``trainloop`` command line.

    Args:
        argv: The arguments (without the program name); ``sys.argv[1:]`` when ``None``.

    Returns:
        The exit code. A run ended by an exit signal raises ``SystemExit`` with its code instead.
    """
    args = _build_parser().parse_args(argv)
    shown = warnings.showwarning
    warnings.showwarning = _one_line_warning(args.command)
    try:
        # The command's module, and torch with it, is imported only now.
        command: Callable[[argparse.Namespace], int] = importlib.import_module(f"trainloop.cli.{args.command}").command
        return command(args)
    except CliError as error:
        for line in str(error).splitlines():  # one line per problem, each saying which command
            print(f"{PROG} {args.command}: error: {line}", file=sys.stderr)
        return error.exit_code
    except Exception as error:
        said = storage_failure(error)
        if said is None:
            raise
        print(f"{PROG} {args.command}: error: {said}", file=sys.stderr)
        return FAILURE
    finally:
        warnings.showwarning = shown


def _one_line_warning(command: str) -> Callable[..., None]:
    """Show a warning as one line naming the command, not Python's two (the second a line of trainloop's source)."""

    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int, file: Any = None,
             line: str | None = None) -> None:
        print(f"{PROG} {command}: warning: {message} ({category.__name__})", file=file or sys.stderr)

    return show
