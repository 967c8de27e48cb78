"""The run's declaration: the settings, where their values come from, and the checks made before anything runs.

The settings model (``model``), where values come from (``sources``: defaults < file < ``TRAINLOOP_*`` environment <
``--set``), how errors are worded (``errors``), the optimizer and schedule declarations (``optimizer``, ``schedule``),
the field types (``types``) and the checks across settings, trainer and hooks made before anything runs (``preflight``).
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
