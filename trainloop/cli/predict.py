"""``trainloop predict SETTINGS``: restore the model, predict every item of the predict data, write one file.

The settings are validated and preflighted as for ``trainloop run`` (the trainer must implement
``build_model``, ``build_predict_data_loader`` and ``predict_step``), then ``trainer.predict()``
runs (see ``BaseTrainer.predict``). Exit codes: 0 written; 1 the checkpoint cannot be used, or the
prediction failed (``predict_step`` returned something else than a tensor or a dict of tensors,
data that cannot give every item once), or the output cannot be written (checked before anything
is built); 2 bad arguments or settings, before anything is built.
One line says what went wrong, and no predictions file is written.
"""

from __future__ import annotations

import argparse
import signal
import sys

from trainloop.checkpoint.errors import CheckpointError
from trainloop.cli.errors import FAILURE, PROG, CliError
from trainloop.cli.run import configure_logging
from trainloop.cli.settings import checked_settings
from trainloop.core.preflight import checked
from trainloop.core.run_kinds import EvaluateError
from trainloop.distributed.gather import GatherError
from trainloop.predict.files import PredictionsFileError, predictions_path
from trainloop.predict.order import PredictDataError
from trainloop.predict.outputs import PredictionError

__all__ = ["command"]


def command(args: argparse.Namespace) -> int:
    """Predict with the settings ``args`` name; a problem is a ``CliError`` (one line, no file written)."""
    settings, trainer_class = checked_settings(args, trainer_required=True, kind="predict")
    assert trainer_class is not None  # required above
    try:
        output = predictions_path(args.output, settings.workspace)
    except ValueError as error:
        raise CliError(f"--output: {error}") from None
    if output is None:
        raise CliError("the settings have no workspace: give --output FILE (.safetensors or .pt)")
    checkpoint = None if args.checkpoint == "none" else args.checkpoint
    configure_logging(args.log_level)
    try:
        with checked(settings, trainer_class):  # the preflight above ran: predict() does not repeat it
            outputs = trainer_class(settings).predict(checkpoint, args.weights, output)
    except (
        CheckpointError, EvaluateError, PredictionError, PredictDataError, GatherError, PredictionsFileError
    ) as error:
        raise CliError(str(error), FAILURE) from None
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT
    items = next(iter(outputs.values())).shape[0] if outputs else 0
    print(f"{PROG} predict: wrote the predictions of {items} items to {output}", file=sys.stderr)
    return 0
