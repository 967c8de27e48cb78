"""``CheckpointingHook``: its settings and their checks, its schedule and exit signals; the rest is the manager's.

The hook decides when a checkpoint is saved and what a run resumes from; its
:class:`~trainloop.checkpoint.manager.CheckpointManager` saves, publishes, prunes, keeps the best
and loads. What a checkpoint holds and every guarantee is in docs/checkpointing.md.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from contextlib import ExitStack, nullcontext
from logging import Logger
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import validate_call

from trainloop.checkpoint.best import BestCheckpoints, Monitor, check_best
from trainloop.checkpoint.deepspeed import deepspeed_engine
from trainloop.checkpoint.errors import CheckpointSaveError
from trainloop.checkpoint.manager import CheckpointManager, sharded_state_dict
from trainloop.checkpoint.storage import is_dir
from trainloop.core.workspace import hold_run_location, path_problem
from trainloop.distributed.ranks import is_rank_zero
from trainloop.hook_machinery.base import BaseHook
from trainloop.hook_machinery.checks import HookProblem, listed, needs_workspace, one_process
from trainloop.hook_machinery.registry import register_hook
from trainloop.hook_machinery.schedule import Schedule
from trainloop.hooks.early_stopping import MonitorNotFoundWarning
from trainloop.hooks.exit_signals import DEFAULT_EXIT_SIGNALS, ExitCode, ExitOnSignal, ExitSignal, as_signal
from trainloop.location import Location, StorageError, UnknownStorageOptions, UrlPath, is_url, location
from trainloop.settings.types import NonNegativeFloat, NonNegativeInt, PathOrUrl, PositiveInt, StrictBool
from trainloop.utils import flatten_nested_dict, warn_user

if TYPE_CHECKING:
    import signal

    from trainloop.core.run_state import TrainerView

__all__ = ["CheckpointingHook"]


@register_hook("checkpointing")
class CheckpointingHook(BaseHook):
    """Save checkpoints on a schedule and on exit signals; prune old ones; resume from one.

    Its schedule saves in the ``checkpointing`` state after every ``interval``-th step (or epoch),
    every ``keep_interval``-th step and the ``keep_steps``, and after the last step of a run that
    ends cleanly, an exit signal's included. Each save is atomic; ``latest`` follows once it is
    complete (docs/checkpointing.md has the layout and the guarantees).

    Args:
        interval: Save every ``interval`` steps (or epochs, see ``unit``).
        keep_previous: Besides the newest checkpoint, keep this many earlier ones (by step).
        keep_best: Also keep this many best checkpoints by ``monitor`` (0: none).
        monitor: The flattened key of a logged metric that ranks checkpoints (e.g.
            ``"val/loss"``); required with ``keep_best`` and only with it.
        mode: ``"min"`` if a lower ``monitor`` is better, ``"max"`` if higher is.
        keep_interval: Also save, and never prune, every ``keep_interval``-th step (0: none).
        keep_steps: Also save, and never prune, these steps.
        path: Directory of the checkpoints; a relative path is resolved under the trainer's
            ``workspace``. Or an fsspec URL (``s3://bucket/run``, ``gs://...``, ``memory://...``;
            ``file://`` is a local path): the same layout on object storage, where a
            checkpoint counts once its manifest, uploaded last, is there (see
            docs/checkpointing.md); needs ``trainloop[s3]`` or ``trainloop[gcs]``.
        storage_options: For a URL ``path`` or ``load``: the options of its fsspec filesystem,
            passed as given (``{"endpoint_url": "http://minio:9000"}``), over fsspec's own
            configuration (``FSSPEC_S3_ENDPOINT_URL``...).
        load: What to resume from in ``restoring``: ``"latest"`` (the newest complete
            checkpoint under ``path``, if any: one that fails its manifest is skipped with a
            warning naming it), a checkpoint directory (relative to the working directory, or
            a URL; must exist and be complete, else an error names the bad file), or ``None``
            (start fresh).
        exit_signals: Signals (names or numbers) that end the run cleanly: the current step
            finishes (under a process group, the step all ranks agree on, a little later), is
            saved, and ``train()`` raises ``SystemExit(exit_code)``. By default SIGTERM
            (preemption; what torchrun forwards), SIGUSR1 (``sbatch --signal=USR1@90``) and
            SIGINT (Ctrl-C: 130); a Ctrl-C after the first signal exits at once, without the
            save, saying so; any other repeated signal is ignored until the save is done.
            ``[]`` or ``None``: none. The handlers are installed for the run only (the defaults
            only in the main thread; signals given explicitly elsewhere are an error).
        exit_code: The exit code after such a signal: ``"128+signal"`` (a shell's convention,
            143 for SIGTERM) or a number.
        exit_wait: Seconds to wait before that last save (e.g. for a cluster scheduler that
            signals every task of a job a little apart).
        format: ``"full"``: rank 0 writes whole tensors, one ``torch.save`` file per state
            entry. ``"sharded"``: every rank writes its shard of the model, optimizer and hook
            states with ``torch.distributed.checkpoint``.
        async_save: Write in the background, from a copy of the state in CPU memory (in the
            full format, parameters and optimizer state are copied in the background too, and
            the next optimizer step waits for that copy); ``latest`` and pruning follow once
            the write is complete. One save is in flight at most: the next save, a load and
            the end of the run wait for it. The copy is held only while a save is in flight
            (from CUDA, its pinned buffers are kept for the next save).
        on_save_error: When the system refuses a write (disk full, permission denied...),
            nothing partial is left and earlier checkpoints are intact; then ``"raise"`` a
            :class:`CheckpointSaveError` naming the checkpoint and the error, or ``"warn"``
            and train on. A background save's failure is reported when the next save
            begins, or at the end of the run. A state that cannot be written at all (an
            object that cannot be pickled) raises a :class:`CheckpointError` either way.
        unit: ``"steps"`` or ``"epochs"``: what ``interval`` counts.

    Raises:
        pydantic.ValidationError: A parameter is invalid; the error names it.
    """

    writes_to = ("path",)

    @classmethod
    def claimed_signals(cls, declared: Any) -> list[signal.Signals]:
        """The ``exit_signals`` a declared hook names; left to the default, one handler serves every hook."""
        if "exit_signals" not in declared.model_fields_set:
            return []
        return [as_signal(s) for s in declared.exit_signals or ()]

    @classmethod
    def check_settings(cls, declared: Any, settings: Any, trainer: Any) -> list[HookProblem]:
        """A relative ``path`` needs a workspace; a URL, its filesystem installed.

        A ``load`` directory must exist, and under ``deepspeed`` the latest checkpoint must have been saved at the
        declared ZeRO stage and precision (checked in a single process only: under a launcher, rank 0 checks it for
        every rank when loading, and the engine before it reads the checkpoint).
        """
        options = declared.storage_options
        problems: list[HookProblem] = []
        if is_url(declared.path):
            problems += _url_problems("path", declared.path, options)
        else:
            problems += needs_workspace(
                settings, declared.path, "path", f"checkpoints go to {str(declared.path)!r}, a relative path"
            )
        if is_url(declared.load):
            problems += _url_problems("load", declared.load, options, must_exist=one_process())
        elif isinstance(declared.load, Path) and one_process() and not declared.load.expanduser().is_dir():
            problems.append(("load", f"no checkpoint directory at {str(declared.load)!r}"))
        if settings.deepspeed is not None and declared.load == "latest" and one_process() and not problems:
            problems += [("load", line) for line in _engine_layout_problems(declared.path, settings)]
        return problems

    @classmethod
    def check_together(cls, declared: Sequence[tuple[int, Any]], settings: Any) -> list[str]:
        """At most one hook loads a checkpoint, and no two write into one directory."""
        problems = []
        loading = [i for i, spec in declared if spec.load is not None]
        if len(loading) > 1:
            problems.append(
                f"{listed(loading)}: each would load a checkpoint into the trainer; set load to null on all but one"
            )
        by_directory: dict[Path | str, list[int]] = {}
        for i, spec in declared:
            path: Path | str = spec.path
            if not is_url(path):
                path = Path(path).expanduser()
                if not path.is_absolute() and settings.workspace is not None:
                    path = settings.workspace / path
            by_directory.setdefault(path, []).append(i)
        problems += [
            f"{listed(indices)}: both write checkpoints to {str(path)!r}; give each its own path"
            for path, indices in by_directory.items() if len(indices) > 1
        ]
        return problems

    @validate_call
    def __init__(
        self,
        interval: PositiveInt,
        keep_previous: NonNegativeInt = 0,
        keep_best: NonNegativeInt = 0,
        monitor: Monitor = None,
        mode: Literal["min", "max"] = "min",
        keep_interval: NonNegativeInt = 0,
        keep_steps: list[PositiveInt] | None = None,
        path: PathOrUrl = Path("checkpoints"),
        storage_options: dict[str, Any] | None = None,
        load: Literal["latest"] | PathOrUrl | None = "latest",
        exit_signals: list[ExitSignal] | None = list(DEFAULT_EXIT_SIGNALS),  # noqa: B006 - never mutated
        exit_code: Literal["128+signal"] | ExitCode = "128+signal",
        exit_wait: NonNegativeFloat = 0.0,
        format: Literal["full", "sharded"] = "full",
        async_save: StrictBool = False,
        on_save_error: Literal["raise", "warn"] = "raise",
        unit: Literal["steps", "epochs"] = "steps",
    ) -> None:
        check_best(keep_best, monitor)
        self.interval = interval
        self.unit = unit
        self.schedule = Schedule(
            interval, unit, state="checkpointing", also_every=keep_interval, also_at=frozenset(keep_steps or ())
        )
        self.keep_previous = keep_previous
        self.keep_best = keep_best
        self.monitor = monitor
        self.mode = mode
        self.keep_interval = keep_interval
        self.keep_steps = frozenset(keep_steps or ())
        if storage_options is not None and not (is_url(path) or is_url(load)):
            raise ValueError("storage_options are for a URL path or load, and neither is a URL")
        self.storage_options = storage_options
        self.path: Location = location(path, storage_options)
        self.load: Location | Literal["latest"] | None = (
            None if load is None else "latest" if load == "latest" else location(load, storage_options)
        )
        # Validation gave canonical names (the default holds some already), made signals here;
        # dict.fromkeys drops repeats, keeps order.
        self.exit_signals = tuple(dict.fromkeys(as_signal(s) for s in exit_signals or ()))
        self.exit_code = exit_code
        self.exit_wait = exit_wait
        self.format = format
        self.async_save = async_save
        self.on_save_error = on_save_error
        # Signals given explicitly must be installed; the defaults only where Python can.
        explicit = exit_signals is not None and list(exit_signals) != list(DEFAULT_EXIT_SIGNALS)
        self._signals = ExitOnSignal(self.exit_signals, required=explicit, name="CheckpointingHook exit_signals")
        self._first_step = 0  # the step this run started from
        self.resumed_complete = False  # the last run resumed a completed run (and so trained nothing)
        self._manager: CheckpointManager | None = None  # the run's checkpoints, from restoring on
        self._held = ExitStack()  # the lock on the checkpoint location, for the run's life

    def on_enter_restoring(self, trainer: TrainerView) -> None:
        """Load the checkpoint ``load`` names, if any, into the trainer."""
        root = self.directory(trainer)  # fails early on a relative path without workspace
        if isinstance(root, Path) and one_process():  # a hook built in code: the preflight did not see its path
            problem = path_problem(root)
            if problem is not None:
                raise ValueError(f"CheckpointingHook path: {problem}")
        if self._manager is not None:  # a hook used again: its last run's save completes first
            self._report(trainer, self._manager.close())
        self._hold(trainer, root)
        best = BestCheckpoints(self.monitor, self.mode, self.keep_best) if self.monitor is not None else None
        engine = deepspeed_engine(trainer.model)  # its own format: every rank its partitions
        self._manager = CheckpointManager(
            root, self.format if engine is None else "deepspeed", self.async_save, trainer.logger,
            keep_previous=self.keep_previous, keep_interval=self.keep_interval, keep_steps=self.keep_steps, best=best,
            engine=engine,
        )
        self.resumed_complete = False
        if self.load is None:
            return
        directory = self._manager.load(trainer, self.load)
        if directory is None:
            init = trainer.settings.init_from
            start = "scratch" if init is None else f"the init_from weights ({init.path})"
            _say(trainer.logger, "No checkpoint in %s: starting from %s", root, start)
            return
        planned = trainer.run_length.planned_steps
        self.resumed_complete = planned is not None and trainer.step >= planned
        if self.resumed_complete:
            _say(
                trainer.logger, "Resumed from %s at step %d: the run is already complete (%d steps); nothing to train",
                directory, trainer.step, planned,
            )
        else:
            _say(trainer.logger, "Resumed from %s at step %d", directory, trainer.step)

    def on_before_train(self, trainer: TrainerView) -> None:
        """Install the exit-signal handlers for the run."""
        self._first_step = trainer.step
        self._signals.install(trainer.logger)

    def on_after_step(self, trainer: TrainerView) -> None:
        """After an exit signal, request the exit (the schedule then saves the step the ranks stop at)."""
        if self._signals.caught is not None:
            self._signals.request_exit(trainer, self.exit_code)

    def on_log(self, trainer: TrainerView, records: dict[str, Any]) -> None:
        """Hand the logged metrics to the manager: the next ``metadata.json`` holds them, ``monitor`` ranks by them."""
        if self._manager is not None:
            self._report(trainer, self._manager.log(trainer.step, flatten_nested_dict(records)))

    def on_schedule(self, trainer: TrainerView) -> None:
        """Save the trainer's state, in ``checkpointing``; ``latest`` and pruning follow once it is complete."""
        assert self._manager is not None, "restoring made the manager"
        if self.exit_wait and self._signals.caught is not None:
            self._signals.wait_before_save(trainer.logger, self.exit_wait)
        if self.async_save:
            self._report(trainer, self._manager.settle(agree=True))  # one save in flight at most
        with sharded_state_dict(trainer) if self.format == "sharded" else nullcontext():
            state_dict = trainer.state_dict()  # on every rank: collectives gather and shard
        error = self._manager.save(trainer.step, state_dict, tuple(trainer.optimizers.values()))
        self._report(trainer, error)

    def _report(self, trainer: TrainerView, error: BaseException | None) -> None:
        if error is None:
            return
        if self.on_save_error == "raise" or not isinstance(error, CheckpointSaveError):
            raise error
        trainer.logger.warning("%s; training goes on (on_save_error='warn')", error)

    def on_after_train(self, trainer: TrainerView) -> None:
        """Wait for a save in flight.

        Then give the exit signals back to their previous handlers; warn if ``monitor`` was never logged.

        In that order: a second SIGTERM while the exit save completes must not find the
        default handler, which would kill the process and lose the save.
        """
        # A run that trained no step (resumed complete) logged nothing: nothing to warn about.
        ran = trainer.step > self._first_step
        best = self._manager.best if self._manager is not None else None
        missing = best.missing_message() if best is not None and trainer.error is None and ran else None
        if missing is not None:
            warn_user(f"{type(self).__name__}: {missing}", MonitorNotFoundWarning)
        try:
            if self._manager is not None:
                self._report_at_exit(trainer, self._manager.close())  # pruned checkpoints are gone after it
        finally:
            self._signals.restore()
            self._held.close()

    def _hold(self, trainer: TrainerView, root: Location) -> None:
        """Hold ``root`` for this run (the workspace's own lock holds it when it is the workspace).

        Raises:
            WorkspaceBusyError: Another live run writes its checkpoints there.
        """
        self._held.close()
        workspace = trainer.settings.workspace
        if isinstance(root, Path) and workspace is not None and root.resolve() == workspace.resolve():
            return
        self._held.enter_context(hold_run_location(root, trainer.logger))

    def _report_at_exit(self, trainer: TrainerView, error: BaseException | None) -> None:
        if error is not None and trainer.error is not None:
            trainer.logger.error("The last checkpoint was not saved either: %s", error)
            return
        self._report(trainer, error)

    @property
    def best_checkpoint(self) -> Location | None:
        """The best checkpoint by ``monitor`` still on disk, or ``None``.

        ``None`` when there is no ``keep_best``, or no checkpoint was scored yet.
        """
        return self._manager.best_checkpoint if self._manager is not None else None

    def directory(self, trainer: TrainerView) -> Location:
        """Where this hook's checkpoints live for ``trainer`` (a local directory or a URL's).

        Raises:
            ValueError: ``path`` is relative and the trainer has no workspace.
        """
        if isinstance(self.path, UrlPath) or self.path.is_absolute():
            return self.path
        if trainer.workspace is None:
            raise ValueError(
                f"CheckpointingHook path={str(self.path)!r} is relative but the trainer has no "
                "workspace; set the trainer's workspace or give an absolute path"
            )
        return trainer.workspace / self.path

    def checkpoint_directory(self, trainer: TrainerView) -> Location:
        """Where this hook keeps the run's checkpoints: its ``directory``."""
        return self.directory(trainer)


def _engine_layout_problems(path: Path | str, settings: Any) -> list[str]:
    """The ways the latest checkpoint under ``path`` was saved by another DeepSpeed engine than ``settings`` declare.

    Its ZeRO stage and precision: what the engine's load would refuse (``load_engine``), found before anything is
    built. Unverified, as the preflight reads files: a checkpoint the load finds corrupt is checked there.
    """
    from trainloop.checkpoint.deepspeed import layout_problems
    from trainloop.checkpoint.manager import latest_step
    from trainloop.settings.deepspeed import read_config, zero_stage

    if is_url(path):
        return []  # DeepSpeed's checkpoints are local
    root = Path(path).expanduser()
    root = root if root.is_absolute() else Path(settings.workspace) / root
    step = latest_step(root)
    if step is None or not (root / str(step) / "metadata.json").is_file():
        return []
    stage = zero_stage(read_config(settings.deepspeed))
    return layout_problems(root / str(step), {"zero_stage": stage, "precision": settings.mixed_precision or "fp32"})


def _say(logger: Logger, message: str, *args: Any) -> None:
    """Tell the user (rank 0) what the run starts from.

    Logged at INFO when logging is configured, else one line on stderr (Python shows no INFO record by default).
    """
    if not is_rank_zero():
        return
    if logger.hasHandlers():
        logger.info(message, *args)
    else:
        print(f"trainloop: {message % args}", file=sys.stderr, flush=True)


def _url_problems(name: str, url: str, options: dict[str, Any] | None, must_exist: bool = False) -> list[HookProblem]:
    """What is wrong with the URL ``url`` of parameter ``name``: its filesystem missing; nothing there to load."""
    try:
        where = location(url, options)
    except UnknownStorageOptions as error:
        return list(error.problems)
    except StorageError as error:
        return [(name, str(error))]
    if must_exist and not is_dir(where):
        return [(name, f"no checkpoint directory at {url!r}")]
    return []
