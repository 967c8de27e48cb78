"""The run's declaration: the settings model (``model``), where values come from (``sources``:
defaults < file < ``TRAINLOOP_*`` environment < ``--set``), how errors are worded (``errors``),
the optimizer and schedule declarations (``optimizer``, ``schedule``), the field types
(``types``) and the checks across settings, trainer and hooks made before anything runs
(``preflight``)."""

from trainloop.settings.model import ENV_PREFIX, TRAINER_PATTERN, TrainerSettings
from trainloop.settings.sources import SettingsFileError

__all__ = ["ENV_PREFIX", "TRAINER_PATTERN", "SettingsFileError", "TrainerSettings"]
