"""``BaseTrainer``: the user's contract (``trainloop.contract``) and the machine seen from outside.

The work of each state is ``trainloop.loop``'s; the run's values it shows read-only are declared
by ``trainloop.run_state.RunAttributes``, the built components by ``Contract``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from logging import Logger
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from trainloop import preflight
from trainloop.contract import Contract
from trainloop.evaluation import WeightsSource
from trainloop.loop import Loop
from trainloop.machine.runner import Handle
from trainloop.machine.table import State, Transition
from trainloop.machine.trace import Trace
from trainloop.metrics import MetricsLog
from trainloop.nested import Records
from trainloop.predict.files import predictions_path
from trainloop.predict.run import PredictRun
from trainloop.result import RunKind, RunResult, finish_run
from trainloop.run_length import RunLength
from trainloop.run_state import EARLY_COMPONENTS, RunAttributes, RunState
from trainloop.settings.model import TrainerSettings, resolve_settings
from trainloop.step import NO_CONTEXT, LossNoneWarning
from trainloop.training_state import ChangedSettingsWarning, load_training_state, training_state
from trainloop.workspace import hold_run_workspace
from trainloop.wrappers import unwrap_model

if TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

__all__ = ["BaseTrainer", "ChangedSettingsWarning", "LossNoneWarning"]

_PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16}


class BaseTrainer(Contract, RunAttributes):
    """A training loop whose sequencing is an explicit state machine.

    Subclass it and implement ``build_data_loader``, ``build_model``,
    ``build_optimizer`` and ``forward``; optionally ``build_lr_scheduler``,
    ``build_grad_scaler`` and ``build_hooks``. Construct it from keyword arguments,
    a settings object, or both (keywords override)::

        MyTrainer(max_steps=1000, mixed_precision="bf16", workspace="runs/a").train()
        MyTrainer(TrainerSettings.from_file("run.json")).train()

    Either way ``trainer.settings`` is the validated, frozen settings object (of
    ``settings_class``, which a subclass may point at its own ``TrainerSettings`` subclass).

    Args:
        settings: A settings object; keyword arguments are validated into one when omitted.
        state_dict_options: Options for ``torch.distributed.checkpoint.state_dict`` (runtime
            only, not part of the settings).
        logger: Where the trainer and its hooks log; ``logging.getLogger("trainloop")`` if omitted.
        **kwargs: Fields of ``settings_class`` (see ``TrainerSettings``).

    Raises:
        pydantic.ValidationError: A setting is invalid; the error names the field.
    """

    settings_class: ClassVar[type[TrainerSettings]] = TrainerSettings

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Refuse a subclass that overrides ``evaluate``: the run would silently be the user's method."""
        super().__init_subclass__(**kwargs)
        if "evaluate" in vars(cls):
            raise TypeError(
                f"{cls.__name__}.evaluate overrides BaseTrainer.evaluate(), the evaluate run: rename your "
                "validation method (e.g. val_metrics) and point ValidationHook(evaluate=...) at the new name"
            )

    def __init__(
        self,
        settings: TrainerSettings | None = None,
        /,
        *,
        state_dict_options: StateDictOptions | None = None,
        logger: Logger | None = None,
        **kwargs: Any,
    ) -> None:
        self.settings = resolve_settings(self.settings_class, settings, kwargs, owner=type(self).__name__)
        self.state_dict_options = state_dict_options
        self.logger = logger if logger is not None else logging.getLogger("trainloop")
        self.device = (
            torch.device(self.settings.device) if self.settings.device else torch.get_default_device()
        )
        self.run_length = RunLength(self.settings)  # where the run ends: max_steps, max_epochs
        self.metrics = MetricsLog()  # every trainer.log call; metrics.jsonl in the workspace
        self.result: RunResult | None = None
        self._loop = Loop(self)
        self._run: RunState = self._loop.run_state
        self._run.built.update(self.__dict__.pop(EARLY_COMPONENTS, {}))
        self._machine = self._loop.machine
        self._requests = self._loop.requests

    # -- the machine, seen from outside --------------------------------------------------------

    @property
    def state(self) -> State:
        """The machine's current state."""
        return self._machine.state

    @property
    def loop(self) -> Loop:
        """The loop that runs this trainer and owns its run state.

        Machinery: tools such as ``lr_find`` use it; hooks read the trainer instead.
        """
        return self._loop

    @property
    def trace(self) -> Trace | None:
        """The transitions fired so far when ``settings.trace`` is on, else ``None``."""
        return self._machine.trace

    @property
    def max_steps(self) -> int:
        """The run's planned steps.

        ``settings.max_steps``, or fewer when ``max_epochs`` ends it first (see ``RunLength.planned_steps``; known once
        the data loader is built).
        """
        return self.run_length.planned_steps or 0

    @property
    def workspace(self) -> Path | None:
        """``settings.workspace``."""
        return self.settings.workspace

    def on_enter(self, state: State | str, fn: Callable[[BaseTrainer], Any]) -> Handle:
        """Call ``fn(trainer)`` each time the machine enters ``state``."""
        return self._machine.on_enter(state, fn)

    def on_exit(self, state: State | str, fn: Callable[[BaseTrainer], Any]) -> Handle:
        """Call ``fn(trainer)`` each time the machine leaves ``state``."""
        return self._machine.on_exit(state, fn)

    def on_transition(
        self, source: State | str, dest: State | str, fn: Callable[[BaseTrainer], Any]
    ) -> Handle:
        """Call ``fn(trainer)`` each time the machine moves from ``source`` to ``dest``."""
        return self._machine.on_transition(source, dest, fn)

    def on_edge(self, fn: Callable[[BaseTrainer, Transition], Any]) -> Handle:
        """Call ``fn(trainer, transition)`` as every edge fires, before anything it does (see ``StateMachine.on_edge``).

        What runs from one call to the next is the entered state's work: ``ProfilerHook`` wraps each state in a range
        this way. Every edge leaves the fast path while ``fn`` is attached; ``remove()`` the handle when done.
        """
        return self._machine.on_edge(fn)

    def diagram(self, format: str = "mermaid") -> str:
        """The machine as Mermaid (``"mermaid"``) or Graphviz DOT (``"dot"``) source text, or as SVG (``"svg"``)."""
        return self._machine.diagram(format)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The mixed-precision context ``forward`` runs under (a no-op when it is off).

        Use it to evaluate under the same precision as training.
        """
        dtype = _PRECISIONS.get(self.settings.mixed_precision or "")
        return torch.autocast(self.device.type, dtype=dtype) if dtype is not None else NO_CONTEXT

    def request_checkpoint(self, at_exit: bool = False) -> None:
        """Ask for a checkpoint at the end of the current step (the machine enters ``checkpointing``).

        Args:
            at_exit: Instead, a standing request: checkpoint whenever the run ends cleanly
                (``max_steps`` reached or an exit requested), unless this step was just saved.
                A run that ends by an error is not saved.
        """
        self._requests.request_checkpoint(at_exit)

    def request_exit(self, exit_code: int | None = None) -> None:
        """Ask the run to end cleanly at the end of the current step.

        Under a process group the ranks agree first (see ``ExitAgreement``):
        all of them stop after the same step, a little after the first request (about 0.1 s,
        or one step if steps are longer, without a collective on every step).

        Args:
            exit_code: If given, ``train()`` raises ``SystemExit(exit_code)`` once ``exiting``
                has run (a signal exit, for example). Ranks agree on the highest code asked for.
        """
        self._requests.request_exit(exit_code)

    @property
    def exit_requested(self) -> bool:
        """Whether the run will end after this step (on every rank, once the ranks agreed)."""
        return self._requests.exit_agreed

    @property
    def exit_code(self) -> int | None:
        """The exit code agreed on with an exit request, or ``None``."""
        return self._requests.exit_code

    # -- the loop ------------------------------------------------------------------------------

    def train(self) -> RunResult:
        """Run the machine until it reaches ``exiting``.

        In pseudocode (each line is the work of one state, or of an edge's action)::

            building:       build data loader, model, optimizer, lr scheduler, grad scaler, hooks
            restoring:      on_enter_restoring hooks (checkpoint load); on_before_train
            loop:
              begin_step:   (edge) step += 1; on_before_step
              accumulating: draw a batch, forward, backward (under no_sync but the step's last)
              ...again while microsteps remain (accumulating -> accumulating)
              stepping:     unscale, normalise, clip, check gradients; optimizer and scheduler
                            step; on_after_step
              retrying:     (non-finite gradients) zero grads, reset the step's records, count;
                            then redo_step (edge) back to accumulating, the step not advanced
              checkpointing: on_enter_checkpointing hooks save
            exiting:        on_after_train; close the data iterator

        The next state is chosen by ``trainloop.machine.table.TRANSITIONS``; every decision about what
        follows an update (retry, save, exit, next step) leaves from ``stepping``. The work of
        each state is ``trainloop.loop.Loop``'s.

        Returns:
            What the run did: its last step, epochs, exit code, last metrics and best
            checkpoint (also kept as ``trainer.result``).

        Raises:
            trainloop.preflight.PreflightError: The settings and this trainer class cannot work
                together; nothing was built or written.
            RuntimeError: Gradients stayed non-finite beyond ``max_non_finite_grad_retries``.
            trainloop.data.DataExhaustedError: A one-shot iterator ran out before ``max_steps``.
            SystemExit: A hook requested exit with an exit code.
            trainloop.workspace.WorkspaceBusyError: Another run holds the workspace; nothing
                was written.
        """
        preflight.check(self)  # before anything is built or written: see trainloop.preflight
        with hold_run_workspace(self.settings.workspace, self.logger):  # one run per workspace
            self._run_machine("train")
        if self.exit_code is not None:
            raise SystemExit(self.exit_code)
        assert self.result is not None
        return self.result

    def evaluate(self, checkpoint: str | Path | None = "latest", weights: str = "model") -> dict[str, float]:
        """Run every validation hook once on restored weights, and return their metrics.

        ``building -> restoring -> validating -> exiting``: built as for training, the model's weights
        alone restored, each ``ValidationHook`` run once (no other hook runs), on every rank. Writes
        nothing but its line in ``runs.jsonl``, takes no workspace lock (see ``trainloop.evaluation``).

        Args:
            checkpoint: ``"latest"``: the run's latest complete checkpoint (an error if there is
                none); a checkpoint directory, full or sharded, or a checkpoints root; ``None``:
                the model as built (``settings.init_from`` applied).
            weights: ``"model"``, ``"ema"`` (the EMA hook's averaged weights) or the name of the
                EMA hook whose weights to take.

        Returns:
            The metrics as logged, flattened (``{"val/loss": 0.31}``); also in ``trainer.result``
            (``kind="evaluate"``, ``step``: the checkpoint's).

        Raises:
            trainloop.evaluation.EvaluateError: No ValidationHook.
            trainloop.checkpoint.errors.CheckpointError: No checkpoint to restore, or one that
                cannot be read or does not fit the model.
        """
        source = WeightsSource.of(checkpoint, weights)
        preflight.check(self)
        self._run_machine("evaluate", source)
        assert self.result is not None
        return dict(self.result.metrics)

    def predict(
        self, checkpoint: str | Path | None = "latest", weights: str = "model", output: str | Path | None = None
    ) -> dict[str, torch.Tensor]:
        """Predict every item of ``build_predict_data_loader()``'s data once, and write the outputs in dataset order.

        The path is ``building`` (predict data and model only) ``-> restoring -> predicting -> exiting``:
        the outputs of every rank gathered, a ``DistributedSampler``'s padding dropped, item ``i``
        at row ``i``; rank 0 writes one file atomically, replacing an existing one. Nothing else
        is written but the run's ``runs.jsonl`` line (``"kind": "predict"``); no workspace lock is
        taken. See docs/predict.md.

        Args:
            checkpoint: ``"latest"``: the run's latest checkpoint (as ``evaluate()``); a
                checkpoint directory, full or sharded (or a checkpoints root, or a workspace);
                ``None``: the model as built (with ``settings.init_from``'s weights if declared).
            weights: ``"model"``, ``"ema"`` (the one EMA hook's averaged weights) or the name of
                the EMA hook whose weights to use.
            output: The file to write, ``.safetensors`` or ``.pt``/``.pth``; by default
                ``<workspace>/predictions.safetensors`` (nothing is written without a workspace).

        Returns:
            The outputs by name (``"predictions"`` when ``predict_step`` returns one tensor),
            row ``i`` being item ``i`` of the dataset, on every rank (CPU tensors).

        Raises:
            ValueError: ``output`` is not a ``.safetensors`` or ``.pt`` file; nothing was built.
            trainloop.evaluation.EvaluateError: ``weights`` given without a checkpoint; nothing was built.
            trainloop.preflight.PreflightError: The trainer cannot predict (no
                ``predict_step`` or ``build_predict_data_loader``) or the settings cannot run.
            trainloop.checkpoint.CheckpointError: The checkpoint is missing, corrupt or lacks the weights.
            trainloop.predict.outputs.PredictionError: ``predict_step`` returned something else
                than a tensor or a dict of tensors per item; the error names the batch.
            trainloop.predict.order.PredictDataError: The data cannot give every item once in a known order.
        """
        source = WeightsSource.of(checkpoint, weights)
        path = predictions_path(output, self.workspace)
        preflight.check(self, kind="predict")
        predict_run = PredictRun(self, self._run, source, path)
        self._run_machine("predict", source, predict_run)
        return predict_run.outputs

    def _run_machine(
        self, kind: RunKind, source: WeightsSource | None = None, predict_run: PredictRun | None = None
    ) -> None:
        """Run the machine once, for a run of ``kind``; the result is kept in ``self.result``."""
        if self.state is not State.IDLE:
            raise RuntimeError(
                f"{kind}() runs once per trainer (one run of any kind: train, "
                f"evaluate, predict); this one is in state {self.state.value!r}: make a new trainer"
            )
        started = time.time()
        try:
            self._loop.run(kind, source, predict_run)
        finally:
            # A run that trains nothing refused before its weights were restored is not a run.
            self.result = finish_run(self, kind, write=self._loop.of_kind.recorded, started=started)

    # -- state -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The full training state.

        Model, optimizer, scheduler, grad scaler, step, per-rank random generators and data position, settings, and
        hooks' (see ``trainloop.training_state``).
        """
        return training_state(self, self._run)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned (the step and epoch included)."""
        load_training_state(self, self._run, state_dict)

    # -- logging and helpers -------------------------------------------------------------------

    def log(self, records: Records) -> None:
        """Send nested numeric records to every hook's ``on_log``, and record them in ``trainer.metrics``.

        They are also written to ``<workspace>/metrics.jsonl`` (see ``settings.metrics_file``).
        """
        run = self._run
        self.metrics.record(run.step, records)
        for fn in run.dispatch["on_log"]:
            fn(self, records)

    def log_images(self, records: dict[str, Any]) -> None:
        """Send images (e.g. PIL images) to every hook's ``on_log_images``."""
        for fn in self._run.dispatch["on_log_images"]:
            fn(self, records)

    @staticmethod
    def unwrap(module: nn.Module) -> nn.Module:
        """See through ``torch.compile``, DDP, DataParallel and ``AveragedModel``."""
        return unwrap_model(module)

    @property
    def unwrapped_model(self) -> nn.Module:
        """``self.model`` without its wrappers."""
        return unwrap_model(self.model)
