"""trainloop: a minimalist PyTorch training loop driven by validated settings and an explicit
state machine."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainloop import _moved
from trainloop._lazy import lazy_exports
from trainloop.version import __version__ as __version__

if TYPE_CHECKING:  # what type checkers and editors see; at run time each name is imported on first use
    from trainloop.data import DataExhaustedError
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
    from trainloop.lr_find.search import LrFindComponents, LrFindResult, lr_find
    from trainloop.machine.table import TRANSITIONS, State, Transition
    from trainloop.machine.trace import Trace, TraceEntry, TraceSummary, read_trace, summarize_trace
    from trainloop.nested import flatten_nested_dict, key_average, map_nested_tensor
    from trainloop.result import RunResult
    from trainloop.rng import seed_all
    from trainloop.settings.model import SettingsFileError, TrainerSettings
    from trainloop.settings.preflight import PreflightError
    from trainloop.step import StepInfo
    from trainloop.trainer import BaseTrainer, LossNoneWarning

_moved.install()

# Each exported name and the module that defines it. Importing them all here would import torch
# (and torch.distributed, pydantic's models...) for `trainloop --help`, which needs none of them:
# a name's module is imported when the name is first used (PEP 562).
_EXPORTS: dict[str, str] = {
    "DataExhaustedError": "trainloop.data",
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
    "LrFindComponents": "trainloop.lr_find.search",
    "LrFindResult": "trainloop.lr_find.search",
    "lr_find": "trainloop.lr_find.search",
    "TRANSITIONS": "trainloop.machine.table",
    "State": "trainloop.machine.table",
    "Transition": "trainloop.machine.table",
    "Trace": "trainloop.machine.trace",
    "TraceEntry": "trainloop.machine.trace",
    "TraceSummary": "trainloop.machine.trace",
    "read_trace": "trainloop.machine.trace",
    "summarize_trace": "trainloop.machine.trace",
    "flatten_nested_dict": "trainloop.nested",
    "key_average": "trainloop.nested",
    "map_nested_tensor": "trainloop.nested",
    "RunResult": "trainloop.result",
    "seed_all": "trainloop.rng",
    "SettingsFileError": "trainloop.settings.model",
    "TrainerSettings": "trainloop.settings.model",
    "PreflightError": "trainloop.settings.preflight",
    "StepInfo": "trainloop.step",
    "BaseTrainer": "trainloop.trainer",
    "LossNoneWarning": "trainloop.trainer",
}


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

__all__ = [
    "TRANSITIONS",
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
    "DataExhaustedError",
    "Loss",
    "LrFindComponents",
    "LrFindResult",
    "LossNoneWarning",
    "PreflightError",
    "RunResult",
    "SettingsFileError",
    "State",
    "StepInfo",
    "Trace",
    "TraceEntry",
    "TraceSummary",
    "TrainerSettings",
    "Transition",
    "flatten_nested_dict",
    "key_average",
    "lr_find",
    "map_nested_tensor",
    "read_trace",
    "register_hook",
    "seed_all",
    "summarize_trace",
]
