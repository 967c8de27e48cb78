"""The one check that runs before anything is built or written.

``trainloop validate``, ``trainloop run`` and ``BaseTrainer.train()`` all call ``preflight``:
what the settings and the trainer class can tell without building anything is checked here,
so that a run that validates does not fail later on something that was known all along:

- the trainer implements what the run needs (``build_model``, ``forward``...; an optimizer is
  declared or ``build_optimizer`` is overridden);
- each declared hook's class defines hook methods only, and checks its own settings
  (``BaseHook.check_settings``: a method a hook names exists, a hook whose files go under the
  workspace has one, a checkpoint to load from a given directory is there...) and those of the
  run's hooks of its class together (``BaseHook.check_together``: two checkpointing hooks
  loading into one trainer or writing one directory), so a hook a user registers is checked
  alike; a hook whose checks pass is then made from its declaration (nothing runs), so what its
  ``__init__`` refuses, such as a ``Schedule(every=2.5)``, is said here too;
- declared hooks work together: no two save their state under one name, no two claim one exit
  signal (``BaseHook.claimed_signals``);
- the directories the run will write (the workspace, and each hook's ``BaseHook.writes_to``: the
  checkpoint and TensorBoard directories) can be made and written: no file in the way, no NUL
  byte, write permission;
- the device exists on this machine; DeepSpeed is installed when the run declares it;
- the weights ``init_from`` names are there and look readable (a file's header, a checkpoint's
  listing: no tensor is read).

On the command line the preflight runs once: ``trainloop run`` checks the settings (naming the
file or variable of each value) and then trains under ``checked(...)``, which tells ``train()``
that these settings have passed with this trainer class.

Problems are reported all at once, one line each, naming the field as a settings file writes it.
"""

from __future__ import annotations

import functools
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from trainloop.checkpoint.storage import exists
from trainloop.checkpoint.weights import weights_file_problem, weights_problem
from trainloop.core.deepspeed import deepspeed_missing, not_installed
from trainloop.core.step import check_forward
from trainloop.core.workspace import path_problem
from trainloop.hook_machinery.base import BaseHook
from trainloop.hook_machinery.checks import listed, one_process
from trainloop.hook_machinery.dispatch import method_problem, schedule_problem
from trainloop.hook_machinery.registry import HookSettings, hook_types
from trainloop.location import StorageError, UnknownStorageOptions, location
from trainloop.settings.errors import field_path
from trainloop.settings.sources import Key

if TYPE_CHECKING:
    from trainloop.core.result import RunKind
    from trainloop.core.run_state import TrainerContract
    from trainloop.settings.model import TrainerSettings

__all__ = ["PreflightError", "check", "checked", "preflight"]

#: The settings that passed the preflight in this context, with the trainer class they passed with.
_PASSED: ContextVar[tuple[TrainerSettings, type[TrainerContract]] | None] = ContextVar(
    "trainloop_preflight_passed", default=None
)


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
    trainer: type[TrainerContract] | TrainerContract | None = None,
    source_of: Callable[[tuple[Key, ...]], str] | None = None,
    kind: RunKind = "train",
) -> list[str]:
    """What stops ``settings`` from running, found without building or writing anything.

    Args:
        settings: Validated settings.
        trainer: The trainer class (or instance: its instance attributes count too) that will
            run them; ``None`` checks the settings alone.
        source_of: Where the value at a path came from (``SettingsInput.source_of``); when
            given, each line begins with it (``run.yaml: ``, ``--set hooks.0.evaluate=x: ``).
        kind: The run the trainer will do: its contract methods differ (``missing_methods``).

    Returns:
        One line per problem (empty: nothing found), each naming the field as a settings file
        writes it (``hooks[1].evaluate: ...``).
    """
    problems: list[tuple[tuple[Key, ...], str]] = []
    if trainer is not None:
        problems += _contract(settings, trainer, kind)
    problems += _declared_hooks(settings, trainer)
    problems += _combinations(settings)
    problems += _workspace_paths(settings)
    problems += _device(settings)
    problems += _init_from(settings)
    if settings.deepspeed is not None and deepspeed_missing():
        problems.append((("deepspeed",), not_installed()))
    if source_of is None:
        return [line for _, line in problems]
    return [f"{source_of(path)}: {line}" for path, line in problems]


def check(trainer: TrainerContract, kind: RunKind = "train") -> None:
    """``preflight`` of a trainer about to run (``kind``), unless it passed already.

    Skipped when its settings passed it with its class in this context already (see ``checked``).

    Raises:
        PreflightError: A problem was found; nothing was built or written.
    """
    passed = _PASSED.get()
    if passed is not None and passed[0] is trainer.settings and passed[1] is type(trainer):
        return
    problems = preflight(trainer.settings, trainer, kind=kind)
    if problems:
        raise PreflightError(problems)


@contextmanager
def checked(settings: TrainerSettings, trainer_class: type[TrainerContract]) -> Iterator[None]:
    """Within the block, ``check`` passes a ``trainer_class`` trainer of exactly ``settings`` at once.

    It does not run the preflight again: the caller ran it (with the class; an instance's attributes add to what the
    class has, never take away) and found nothing.
    """
    token = _PASSED.set((settings, trainer_class))
    try:
        yield
    finally:
        _PASSED.reset(token)


# -- the trainer ---------------------------------------------------------------------------------


def _class_of(trainer: type[TrainerContract] | TrainerContract) -> type[TrainerContract]:
    return trainer if isinstance(trainer, type) else type(trainer)


def _contract(
    settings: TrainerSettings, trainer: type[TrainerContract] | TrainerContract, kind: RunKind
) -> list[tuple[tuple[Key, ...], str]]:
    cls = _class_of(trainer)
    missing = cls.missing_methods(kind)
    problems: list[tuple[tuple[Key, ...], str]] = [
        ((), f"{cls.__name__} must implement {name}()") for name in missing if name != "build_optimizer"
    ]
    if settings.optimizer is None and settings.optimizers is None and "build_optimizer" in missing:
        problems.append(
            (("optimizer",), f"optimizer: none declared, and {cls.__name__} does not implement build_optimizer()")
        )
    if settings.optimizers is not None and "build_optimizer" in missing and "forward" not in missing:
        # The optimizers come from the settings: forward's signature can be checked before anything is built.
        unbound: Any = cls.forward  # read as bound: its first parameter (self) left out
        forward = trainer.forward if not isinstance(trainer, type) else functools.partial(unbound, None)
        try:
            check_forward(forward, f"{cls.__name__}.forward()", list(settings.optimizers))
        except TypeError as error:
            problems.append((("optimizers",), f"optimizers: {error}"))
    return problems


# -- the declared hooks: each class checks its own ---------------------------------------------


def _declared_hooks(
    settings: TrainerSettings, trainer: type[TrainerContract] | TrainerContract | None
) -> list[tuple[tuple[Key, ...], str]]:
    """Each declared hook's class.

    Its methods, its ``check_settings`` of each hook it is declared as, and its ``check_together`` of them all (once per
    class).
    """
    problems: list[tuple[tuple[Key, ...], str]] = []
    by_class: dict[type[BaseHook], list[tuple[int, HookSettings]]] = {}
    for i, spec in enumerate(settings.hooks):
        cls = hook_types()[spec.type]
        by_class.setdefault(cls, []).append((i, spec))
        misspelt = method_problem(cls)  # a misspelt on_* method of the hook's class would never run
        if misspelt is not None:
            problems.append((("hooks", i), f"{field_path(('hooks', i))}: {misspelt}"))
        own = _pairs(cls, cls.check_settings(spec, settings, trainer))
        for name, message in own:
            path: tuple[Key, ...] = ("hooks", i, name) if name else ("hooks", i)
            problems.append((path, f"{field_path(path)}: {message}"))
        if not own:  # what its __init__ refuses (a Schedule(every=2.5) it makes) is said now, not in building
            try:
                half = schedule_problem(spec.build())  # a schedule with no on_schedule, or the reverse
            except (ValueError, TypeError) as error:
                half = f"{cls.__name__}: {error}"
            if half is not None:
                problems.append((("hooks", i), f"{field_path(('hooks', i))}: {half}"))
    for cls, declared in by_class.items():
        found = cls.check_together(declared, settings)
        if not isinstance(found, list) or not all(isinstance(m, str) for m in found):
            raise TypeError(f"{cls.__qualname__}.check_together returned {found!r}: it must return a list of messages")
        problems += [(("hooks",), message) for message in found]
    return problems


def _pairs(cls: type[BaseHook], found: object) -> list[tuple[str | None, str]]:
    """``check_settings``'s answer, checked: a hook author's mistake is named, not a traceback of ours."""
    if isinstance(found, list) and all(
        isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], (str, type(None))) and isinstance(p[1], str)
        for p in found
    ):
        return found
    raise TypeError(
        f"{cls.__qualname__}.check_settings returned {found!r}: it must return a list of (field name or None, "
        "message) pairs"
    )


# -- hooks together, and the machine -----------------------------------------------------------


def _combinations(settings: TrainerSettings) -> list[tuple[tuple[Key, ...], str]]:
    problems: list[tuple[tuple[Key, ...], str]] = []
    by_state_key: dict[str, list[int]] = {}
    for i, spec in enumerate(settings.hooks):
        cls = hook_types()[spec.type]
        if cls.saves_state():
            by_state_key.setdefault(spec.name or cls.default_name(), []).append(i)
    for key, indices in by_state_key.items():
        if len(indices) > 1:
            problems.append(
                (("hooks",), f'{listed(indices)}: both save their state under the name {key!r}; give each a "name"')
            )
    by_signal: dict[signal.Signals, list[int]] = {}
    for i, spec in enumerate(settings.hooks):
        for sig in hook_types()[spec.type].claimed_signals(spec):
            by_signal.setdefault(sig, []).append(i)
    for sig, indices in by_signal.items():
        if len(indices) > 1:
            problems.append(
                (("hooks",), f"{listed(indices)}: each catches {sig.name}, and a process has one handler per signal")
            )
    return problems


def _workspace_paths(settings: TrainerSettings) -> list[tuple[tuple[Key, ...], str]]:
    """The directories the run writes, each checked by ``trainloop.core.workspace.path_problem``."""
    directories: list[tuple[tuple[Key, ...], Path]] = []
    if settings.workspace is not None:
        directories.append((("workspace",), settings.workspace))
    for i, spec in enumerate(settings.hooks):
        for name in hook_types()[spec.type].writes_to:
            if isinstance(getattr(spec, name, None), Path):
                path = Path(getattr(spec, name))
                if not path.expanduser().is_absolute():
                    if settings.workspace is None:
                        continue  # said by the hook's own check
                    path = settings.workspace / path
                directories.append((("hooks", i, name), path))
    problems: list[tuple[tuple[Key, ...], str]] = []
    for where, path in directories:
        # Under a launcher only the NUL byte is checked: see trainloop.hook_machinery.checks.one_process.
        problem = path_problem(path) if one_process() or "\0" in str(path) else None
        if problem is not None:
            problems.append((where, f"{field_path(where)}: {problem}"))
            if where == ("workspace",):
                break  # the directories under it would only say it again
    return problems


def _init_from(settings: TrainerSettings) -> list[tuple[tuple[Key, ...], str]]:
    spec = settings.init_from
    # Every rank reads the weights itself, so every rank may check that they are there.
    if spec is None:
        return []
    try:
        path = location(spec.path, spec.storage_options)
    except UnknownStorageOptions as error:
        return [(("init_from", *field.split(".")), f"init_from.{field}: {said}") for field, said in error.problems]
    except StorageError as error:
        return [(("init_from", "path"), f"init_from.path: {error}")]
    if not exists(path):
        return [(("init_from", "path"), f"init_from.path: no checkpoint or weights file at {str(spec.path)!r}")]
    unreadable = weights_file_problem(path)
    if unreadable is not None:
        return [(("init_from", "path"), f"init_from.path: {unreadable}")]
    problem = weights_problem(path, spec.weights)
    return [] if problem is None else [(("init_from", "weights"), f"init_from.weights: {problem}")]


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
