"""Hooks: the pieces that plug into a trainer's loop, one module per hook.

Every built-in hook registers a type name, so a settings file can declare it as
``{"type": "<name>", ...parameters}``; ``HookSpec`` is the validated form of one such entry,
its type looked up in the registry when settings are validated.
Heavy optional packages (wandb, tensorboard, PIL, tqdm) are imported only when a hook uses them.
"""

from .base import HOOK_EVENTS, BaseHook, hook_dispatch
from .checkpointing import CheckpointingHook
from .cuda_memory import CudaMaxMemoryHook
from .early_stopping import EarlyStoppingHook
from .ema import EmaHook
from .image_files import ImageFileLoggerHook
from .logging_hook import LoggingHook
from .progress import ProgressHook
from .registry import (
    HOOK_TYPES,
    HookSettings,
    HookSpec,
    build_declared_hooks,
    hook_settings_model,
    register_hook,
    unregister_hook,
)
from .stats import StatsHook, TrainingStats
from .tensorboard import TensorBoardHook
from .validation import ValidationHook
from .wandb import WandbHook

__all__ = [
    "HOOK_EVENTS",
    "HOOK_TYPES",
    "BaseHook",
    "CheckpointingHook",
    "CudaMaxMemoryHook",
    "EarlyStoppingHook",
    "EmaHook",
    "HookSettings",
    "HookSpec",
    "ImageFileLoggerHook",
    "LoggingHook",
    "ProgressHook",
    "StatsHook",
    "TensorBoardHook",
    "TrainingStats",
    "ValidationHook",
    "WandbHook",
    "build_declared_hooks",
    "hook_dispatch",
    "hook_settings_model",
    "register_hook",
    "unregister_hook",
]
