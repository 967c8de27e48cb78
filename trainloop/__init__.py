"""trainloop: a minimalist PyTorch training loop driven by validated settings and an explicit state machine.

The top level is the user's contract: the trainer and hooks to subclass, the built-in hooks, the
settings, what a run reports (``StepInfo``, ``RunResult``, ``State``) and the errors a user
catches. Everything else lives in documented namespaces: ``trainloop.settings``,
``trainloop.machine``, ``trainloop.hooks``, ``trainloop.checkpoint``, ``trainloop.distributed``,
``trainloop.lr_find``, ``trainloop.report`` and ``trainloop.utils`` (docs/architecture.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainloop.lazy import lazy_exports
from trainloop.version import __version__ as __version__  # the package face shows its version

if TYPE_CHECKING:  # what type checkers and editors see; at run time each name is imported on first use
    from trainloop.checkpoint.errors import CheckpointError, CheckpointSaveError
    from trainloop.core.data import DataExhaustedError
    from trainloop.core.preflight import PreflightError
    from trainloop.core.result import RunResult
    from trainloop.core.rng import seed_all
    from trainloop.core.workspace import WorkspaceBusyError
    from trainloop.hooks import (
        BaseHook,
        CheckpointingHook,
        CudaMaxMemoryHook,
        EarlyStoppingHook,
        EmaHook,
        ImageFileLoggerHook,
        LoggingHook,
        ProgressHook,
        StatsHook,
        TensorBoardHook,
        ValidationHook,
        WandbHook,
        register_hook,
    )
    from trainloop.loss import Loss
    from trainloop.lr_find.search import lr_find
    from trainloop.machine.table import State
    from trainloop.settings.model import SettingsFileError, TrainerSettings
    from trainloop.step_info import StepInfo
    from trainloop.trainer import BaseTrainer, LossNoneWarning
    from trainloop.utils import map_nested_tensor

# Each exported name and the module that defines it. Importing them all here would import torch
# (and torch.distributed, pydantic's models...) for `trainloop --help`, which needs none of them:
# a name's module is imported when the name is first used (PEP 562).
_EXPORTS: dict[str, str] = {
    "CheckpointError": "trainloop.checkpoint.errors",
    "CheckpointSaveError": "trainloop.checkpoint.errors",
    "DataExhaustedError": "trainloop.core.data",
    "BaseHook": "trainloop.hooks",
    "CheckpointingHook": "trainloop.hooks",
    "CudaMaxMemoryHook": "trainloop.hooks",
    "EarlyStoppingHook": "trainloop.hooks",
    "EmaHook": "trainloop.hooks",
    "ImageFileLoggerHook": "trainloop.hooks",
    "LoggingHook": "trainloop.hooks",
    "ProgressHook": "trainloop.hooks",
    "StatsHook": "trainloop.hooks",
    "TensorBoardHook": "trainloop.hooks",
    "ValidationHook": "trainloop.hooks",
    "WandbHook": "trainloop.hooks",
    "register_hook": "trainloop.hooks",
    "Loss": "trainloop.loss",
    "lr_find": "trainloop.lr_find.search",
    "State": "trainloop.machine.table",
    "map_nested_tensor": "trainloop.utils",
    "RunResult": "trainloop.core.result",
    "seed_all": "trainloop.core.rng",
    "SettingsFileError": "trainloop.settings.model",
    "TrainerSettings": "trainloop.settings.model",
    "PreflightError": "trainloop.core.preflight",
    "StepInfo": "trainloop.step_info",
    "WorkspaceBusyError": "trainloop.core.workspace",
    "BaseTrainer": "trainloop.trainer",
    "LossNoneWarning": "trainloop.trainer",
}

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

__all__ = [
    # the trainer and the hooks: what a user subclasses and declares
    "BaseHook",
    "BaseTrainer",
    "CheckpointingHook",
    "CudaMaxMemoryHook",
    "EarlyStoppingHook",
    "EmaHook",
    "ImageFileLoggerHook",
    "LoggingHook",
    "ProgressHook",
    "StatsHook",
    "TensorBoardHook",
    "ValidationHook",
    "WandbHook",
    "register_hook",
    # the settings
    "SettingsFileError",
    "TrainerSettings",
    # what forward returns and what a run shows
    "Loss",
    "RunResult",
    "State",
    "StepInfo",
    # what a user catches
    "CheckpointError",
    "CheckpointSaveError",
    "DataExhaustedError",
    "LossNoneWarning",
    "PreflightError",
    "WorkspaceBusyError",
    # helpers a training script imports at the top level
    "lr_find",
    "map_nested_tensor",
    "seed_all",
]
