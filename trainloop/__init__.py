"""trainloop: a minimalist PyTorch training loop driven by validated settings and an explicit
state machine."""

from .data import DataExhaustedError
from .hooks import (
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
from .loss import Loss
from .lr_find import LrFindComponents, LrFindResult, lr_find
from .machine import TRANSITIONS, State, Transition
from .preflight import PreflightError
from .result import RunResult
from .rng import seed_all
from .settings import SettingsFileError, TrainerSettings
from .step import StepInfo
from .trace import Trace, TraceEntry, TraceSummary, read_trace, summarize_trace
from .trainer import BaseTrainer, LossNoneWarning
from .utils import flatten_nested_dict, key_average, map_nested_tensor

__version__ = "0.1.0"

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
