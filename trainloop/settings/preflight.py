"""The one check that runs before anything is built or written.

``trainloop validate``, ``trainloop run`` and ``BaseTrainer.train()`` all call ``preflight``:
what the settings and the trainer class can tell without building anything is checked here,
so that a run that validates does not fail later on something that was known all along:

- the trainer implements what the run needs (``build_model``, ``forward``...; an optimizer is
  declared or ``build_optimizer`` is overridden);
- a method a hook names (``{"type": "validation", "evaluate": "evaluate"}``) exists;
- a hook whose files go under the workspace has one (relative checkpoint or TensorBoard paths,
  image files, wandb), and a checkpoint to load from a given directory is there (in a single
  process: under a launcher the checkpointing hook checks it on rank 0 for every rank);
- declared hooks work together (two checkpointing hooks loading into one trainer or writing one
  directory, two hooks catching one exit signal);
- the device exists on this machine;
- the weights ``init_from`` names are there.

Problems are reported all at once, one line each, naming the field as a settings file writes it.
"""

from __future__ import annotations

import difflib
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from trainloop.distributed.ranks import in_process_group, world_size
from trainloop.exit_signals import as_signal
from trainloop.hooks.dispatch import check_hook_methods
from trainloop.hooks.registry import HOOK_TYPES, HookSettings
from trainloop.settings.errors import field_path
from trainloop.settings.sources import Key

if TYPE_CHECKING:
    from trainloop.settings.model import TrainerSettings
    from trainloop.trainer import BaseTrainer

__all__ = ["PreflightError", "check", "preflight"]

_MISSING = object()


class PreflightError(ValueError):
    """The settings cannot run with this trainer; one line per problem.

    Attributes:
        problems: The lines of the message.
    """

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


def preflight(
    settings: TrainerSettings,
    trainer: type[BaseTrainer] | BaseTrainer | None = None,
    source_of: Callable[[tuple[Key, ...]], str] | None = None,
) -> list[str]:
    """What stops ``settings`` from running, found without building or writing anything.

    Args:
        settings: Validated settings.
        trainer: The trainer class (or instance: its instance attributes count too) that will
            run them; ``None`` checks the settings alone.
        source_of: Where the value at a path came from (``SettingsInput.source_of``); when
            given, each line begins with it (``run.yaml: ``, ``--set hooks.0.evaluate=x: ``).

    Returns:
        One line per problem (empty: nothing found), each naming the field as a settings file
        writes it (``hooks[1].evaluate: ...``).
    """
    problems: list[tuple[tuple[Key, ...], str]] = []
    if trainer is not None:
        problems += _contract(settings, trainer)
    for i, spec in enumerate(settings.hooks):
        try:  # a misspelt on_* method of the hook's class would never run
            check_hook_methods(HOOK_TYPES[spec.type])
        except TypeError as error:
            problems.append((("hooks", i), f"{field_path(('hooks', i))}: {error}"))
        check_hook = _HOOK_CHECKS.get(spec.type)
        if check_hook is not None:
            for name, message in check_hook(spec, settings, trainer):
                path: tuple[Key, ...] = ("hooks", i, name) if name else ("hooks", i)
                problems.append((path, f"{field_path(path)}: {message}"))
    problems += _combinations(settings)
    problems += _device(settings)
    problems += _init_from(settings)
    if source_of is None:
        return [line for _, line in problems]
    return [f"{source_of(path)}: {line}" for path, line in problems]


def check(trainer: BaseTrainer) -> None:
    """``preflight`` of a trainer about to train.

    Raises:
        PreflightError: A problem was found; nothing was built or written.
    """
    problems = preflight(trainer.settings, trainer)
    if problems:
        raise PreflightError(problems)


# -- the trainer ---------------------------------------------------------------------------------


def _class_of(trainer: type[BaseTrainer] | BaseTrainer) -> type[BaseTrainer]:
    return trainer if isinstance(trainer, type) else type(trainer)


def _contract(settings: TrainerSettings, trainer: type[BaseTrainer] | BaseTrainer) -> list[tuple[tuple[Key, ...], str]]:
    from trainloop.trainer import BaseTrainer

    cls = _class_of(trainer)
    problems: list[tuple[tuple[Key, ...], str]] = [
        ((), f"{cls.__name__} must implement {name}()")
        for name in ("build_data_loader", "build_model", "forward")
        if getattr(cls, name) is getattr(BaseTrainer, name)
    ]
    if settings.optimizer is None and cls.build_optimizer is BaseTrainer.build_optimizer:
        problems.append((("optimizer",), f"optimizer: none declared, and {cls.__name__} does not implement build_optimizer()"))
    return problems


# -- one hook at a time: each returns (its parameter at fault or None, what is wrong) ------------

HookProblem = tuple[str | None, str]
HookCheck = Callable[[Any, "TrainerSettings", Any], list[HookProblem]]


def _validation(spec: Any, settings: TrainerSettings, trainer: type[BaseTrainer] | BaseTrainer | None) -> list[HookProblem]:
    name = spec.evaluate
    if trainer is None or not isinstance(name, str):
        return []
    found = getattr(trainer, name, _MISSING)
    cls_name = _class_of(trainer).__name__
    if found is _MISSING:
        methods = [m for m in dir(trainer) if not m.startswith("_") and callable(getattr(trainer, m, None))]
        close = difflib.get_close_matches(name, methods, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return [("evaluate", f"{cls_name} has no method {name!r}{hint}")]
    if not callable(found):
        return [("evaluate", f"{cls_name}.{name} is a {type(found).__name__}, not a method")]
    return []


def _needs_workspace(settings: TrainerSettings, path: Path | None, name: str, what: str) -> list[HookProblem]:
    if settings.workspace is None and (path is None or not Path(path).expanduser().is_absolute()):
        return [(name, f"{what}, but no workspace is set: set workspace or give an absolute path")]
    return []


def _checkpointing(spec: Any, settings: TrainerSettings, trainer: Any) -> list[HookProblem]:
    problems = _needs_workspace(settings, spec.path, "path", f"checkpoints go to {str(spec.path)!r}, a relative path")
    if isinstance(spec.load, Path) and _one_process() and not spec.load.expanduser().is_dir():
        problems.append(("load", f"no checkpoint directory at {str(spec.load)!r}"))
    return problems


def _one_process() -> bool:
    """Whether this process runs alone: only then may a check read the filesystem.

    Under a launcher each rank runs the preflight by itself; a file check could pass on one rank
    and fail on another (no shared filesystem), leaving the others waiting in a collective. The
    checkpointing hook's own check, made on rank 0 and shared with every rank, covers that case.
    """
    if in_process_group():
        return world_size() == 1
    return os.environ.get("WORLD_SIZE", "1") == "1"


def _tensorboard(spec: Any, settings: TrainerSettings, trainer: Any) -> list[HookProblem]:
    where = f"{str(spec.log_dir)!r}, a relative path" if spec.log_dir is not None else "<workspace>/tensorboard"
    return _needs_workspace(settings, spec.log_dir, "log_dir", f"event files go to {where}")


def _workspace_only(what: str) -> HookCheck:
    def check_workspace(spec: Any, settings: TrainerSettings, trainer: Any) -> list[HookProblem]:
        return [(None, f"{spec.type} writes {what}, but no workspace is set")] if settings.workspace is None else []

    return check_workspace


#: Checks of one declared hook, by hook type.
_HOOK_CHECKS: dict[str, HookCheck] = {
    "validation": _validation,
    "checkpointing": _checkpointing,
    "tensorboard": _tensorboard,
    "export": lambda spec, settings, trainer: _needs_workspace(settings, spec.path, "path", f"the weights go to {str(spec.path)!r}, a relative path"),
    "image_files": _workspace_only("images to <workspace>/visualizations"),
    "wandb": _workspace_only("its run id to <workspace>/wandb_run_id"),
}


# -- hooks together, and the machine -----------------------------------------------------------


def _of_type(settings: TrainerSettings, type_name: str) -> Iterator[tuple[int, HookSettings]]:
    return ((i, spec) for i, spec in enumerate(settings.hooks) if spec.type == type_name)


def _combinations(settings: TrainerSettings) -> list[tuple[tuple[Key, ...], str]]:
    problems: list[tuple[tuple[Key, ...], str]] = []
    checkpointing = list(_of_type(settings, "checkpointing"))
    loading = [i for i, spec in checkpointing if getattr(spec, "load", None) is not None]
    if len(loading) > 1:
        listed = " and ".join(f"hooks[{i}]" for i in loading)
        problems.append((("hooks",), f"{listed}: each would load a checkpoint into the trainer; set load to null on all but one"))
    by_directory: dict[Path, list[int]] = {}
    for i, spec in checkpointing:
        # A hook's settings model is made at run time from its __init__: mypy cannot see the field.
        path = Path(spec.path).expanduser()  # type: ignore[attr-defined]
        if not path.is_absolute() and settings.workspace is not None:
            path = settings.workspace / path
        by_directory.setdefault(path, []).append(i)
    for path, indices in by_directory.items():
        if len(indices) > 1:
            listed = " and ".join(f"hooks[{i}]" for i in indices)
            problems.append((("hooks",), f"{listed}: both write checkpoints to {str(path)!r}; give each its own path"))
    by_state_key: dict[str, list[int]] = {}
    for i, spec in enumerate(settings.hooks):
        cls = HOOK_TYPES[spec.type]
        if cls.saves_state():
            by_state_key.setdefault(spec.name or cls.default_name(), []).append(i)
    for key, indices in by_state_key.items():
        if len(indices) > 1:
            listed = " and ".join(f"hooks[{i}]" for i in indices)
            problems.append((("hooks",), f"{listed}: both save their state under the name {key!r}; give each a \"name\""))
    by_signal: dict[signal.Signals, list[int]] = {}
    for i, spec in enumerate(settings.hooks):
        if "exit_signals" not in spec.model_fields_set:
            continue  # defaults: one handler serves every hook (the exit save runs them all)
        for sig in getattr(spec, "exit_signals", None) or ():
            by_signal.setdefault(as_signal(sig), []).append(i)
    for sig, indices in by_signal.items():
        if len(indices) > 1:
            listed = " and ".join(f"hooks[{i}]" for i in indices)
            problems.append((("hooks",), f"{listed}: each catches {sig.name}, and a process has one handler per signal"))
    return problems


def _init_from(settings: TrainerSettings) -> list[tuple[tuple[Key, ...], str]]:
    spec = settings.init_from
    # Every rank reads the weights itself, so every rank may check that they are there.
    if spec is None or spec.path.expanduser().exists():
        return []
    return [(("init_from", "path"), f"init_from.path: no checkpoint or weights file at {str(spec.path)!r}")]


def _device(settings: TrainerSettings) -> list[tuple[tuple[Key, ...], str]]:
    if settings.device is None:
        return []
    device = torch.device(settings.device)
    if device.type == "cuda":
        count = torch.cuda.device_count()
        if count == 0:
            return [(("device",), f"device: {settings.device!r}, but CUDA is not available on this machine")]
        if device.index is not None and device.index >= count:
            return [(("device",), f"device: {settings.device!r}, but this machine has {count} CUDA device(s)")]
    return []
