"""The hook library: the built-in hooks, one module per hook, and the face hook authors import from.

Every built-in hook registers a type name, so a settings file can declare it as
``{"type": "<name>", ...parameters}``; ``HookSpec`` is the validated form of one such entry,
its type looked up in the registry when settings are validated. The machinery the hooks plug
into (``BaseHook``, ``Schedule``, the registry) is ``trainloop.hook_machinery``'s, exported here
too; the engine imports that machinery and never this library.
Heavy optional packages (wandb, tensorboard, PIL, tqdm) are imported only when a hook uses them.
"""

from trainloop.core.run_state import TrainerView
from trainloop.hook_machinery.base import BaseHook
from trainloop.hook_machinery.dispatch import HOOK_EVENTS
from trainloop.hook_machinery.registry import HOOK_TYPES, HookSpec, hook_settings_model, register_hook, unregister_hook
from trainloop.hook_machinery.schedule import Schedule
from trainloop.hooks.checkpointing import CheckpointingHook
from trainloop.hooks.cuda_memory import CudaMaxMemoryHook
from trainloop.hooks.early_stopping import EarlyStoppingHook, MonitorNotFoundWarning
from trainloop.hooks.ema import EmaHook
from trainloop.hooks.export import ExportHook
from trainloop.hooks.image_files import ImageFileLoggerHook
from trainloop.hooks.logging_hook import LoggingHook
from trainloop.hooks.profiler import ProfilerHook
from trainloop.hooks.progress import ProgressHook
from trainloop.hooks.stats import StatsHook, TrainingStats
from trainloop.hooks.tensorboard import TensorBoardHook
from trainloop.hooks.validation import ValidationHook
from trainloop.hooks.wandb import WandbHook

__all__ = [
    "TrainerView",
    "HOOK_EVENTS",
    "HOOK_TYPES",
    "BaseHook",
    "CheckpointingHook",
    "CudaMaxMemoryHook",
    "EarlyStoppingHook",
    "EmaHook",
    "ExportHook",
    "HookSpec",
    "ImageFileLoggerHook",
    "LoggingHook",
    "MonitorNotFoundWarning",
    "ProfilerHook",
    "ProgressHook",
    "Schedule",
    "StatsHook",
    "TensorBoardHook",
    "TrainingStats",
    "ValidationHook",
    "WandbHook",
    "hook_settings_model",
    "register_hook",
    "unregister_hook",
]
