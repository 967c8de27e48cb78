"""trainloop: a minimalist PyTorch training loop driven by validated settings and an explicit
state machine."""

from trainloop import _moved
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
from trainloop.version import __version__ as __version__

_moved.install()


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
