"""The run's declaration: the settings and where their values come from.

The settings model (``model``), where values come from (``sources``: defaults < file < ``TRAINLOOP_*`` environment <
``--set``), how errors are worded (``errors``), the optimizer and schedule declarations (``optimizer``, ``schedule``),
the field types (``types``) and ``init_from``'s. The checks across settings, trainer and hooks made before anything
runs are ``trainloop.core.preflight``, above the hooks and checkpoints they ask.
"""

from trainloop.settings.model import TrainerSettings
from trainloop.settings.sources import SettingsFileError
from trainloop.settings.types import NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, StrictBool

__all__ = [
    "NonNegativeFloat",
    "NonNegativeInt",
    "PositiveFloat",
    "PositiveInt",
    "SettingsFileError",
    "StrictBool",
    "TrainerSettings",
]
