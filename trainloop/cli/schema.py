"""``trainloop schema``: the settings' JSON Schema, printed or written."""

from __future__ import annotations

import argparse
import json

from trainloop.cli.output import write_output
from trainloop.cli.settings import settings_class_for
from trainloop.settings.model import TrainerSettings

__all__ = ["command"]


def _schema_text(settings_class: type[TrainerSettings]) -> str:
    """The JSON Schema of ``settings_class`` as ``schemas/trainer_settings.schema.json`` holds it."""
    return json.dumps(settings_class.json_schema(), indent=2) + "\n"


def command(args: argparse.Namespace) -> int:
    """Print or write the JSON Schema of the settings (of ``--trainer``'s ``settings_class``)."""
    write_output(args.output, _schema_text(settings_class_for(args.trainer)))
    return 0
