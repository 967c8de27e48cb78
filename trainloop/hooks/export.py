"""``ExportHook``: the model's weights written to one ``.safetensors`` file when a run ends."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import Field, validate_call

from trainloop.core.workspace import declared_output_problems, file_problem
from trainloop.distributed.ranks import is_rank_zero
from trainloop.hook_machinery.base import BaseHook
from trainloop.hook_machinery.checks import HookProblem, needs_workspace, one_process
from trainloop.hook_machinery.registry import register_hook
from trainloop.settings.types import NonEmptyPath

if TYPE_CHECKING:
    from trainloop.core.run_state import TrainerView
    from trainloop.hooks.ema import EmaHook

__all__ = ["ExportHook"]


@register_hook("export")
class ExportHook(BaseHook):
    """Export the trained weights to a ``.safetensors`` file at the end of a run.

    Only a run that reached its end exports: not one that failed or stopped on an exit signal
    (its checkpoint resumes it; ``trainloop export`` exports any checkpoint). The file is the
    one ``trainloop export`` writes (see :mod:`trainloop.checkpoint.export`): clean keys, tied
    weights included, metadata with the step and the settings' hash. Under a process group
    every rank gathers the full weights (FSDP needs every rank) and rank 0 writes.

    Args:
        path: The ``.safetensors`` file; a relative path is under the workspace. The preflight
            checks that it can be written (no directory in its place, its directory writable).
        weights: ``"model"``, or ``"ema"`` for the EMA hook's averaged weights.
    """

    @validate_call
    def __init__(
        self,
        path: NonEmptyPath = Path("model.safetensors"),
        weights: Annotated[str, Field(pattern=r"^(model|ema)$")] = "model",
    ) -> None:
        self.path = path
        self.weights = weights
        self.written: Path | None = None

    @classmethod
    def check_settings(cls, declared: Any, settings: Any, trainer: Any) -> list[HookProblem]:
        """``path``: a ``.safetensors`` file the run can write (relative: needs a workspace); ``"ema"``: an EMA hook.

        The EMA hook may be declared in ``settings.hooks`` or built by the trainer's
        ``build_hooks()``, which is not called here: a trainer that overrides it is trusted.
        """
        problems = needs_workspace(
            settings, declared.path, "path", f"the weights go to {str(declared.path)!r}, a relative path"
        )
        problems += _suffix_problem(declared.path) + declared_output_problems(settings, declared.path, "path", "file")
        if declared.weights == "ema" and not any(spec.type == "ema" for spec in settings.hooks):
            trainer_class = trainer if isinstance(trainer, type) else type(trainer)
            build_hooks = getattr(trainer_class, "build_hooks", None)
            # The default (no hooks) is the contract's, in trainloop.trainer: compared by name, as hooks
            # import nothing of the trainer's.
            default = getattr(build_hooks, "__module__", "") == "trainloop.trainer"
            builds_hooks = trainer is not None and not default
            if not builds_hooks:
                problems.append(("weights", "'ema' needs an EMA hook, and settings.hooks declares none"))
        return problems

    def on_before_train(self, trainer: TrainerView) -> None:
        """Refuse now, not after the run trained: ``weights="ema"`` without one EMA hook, a file it cannot write.

        (The preflight said it already of a hook declared in settings; a hook built in Python is checked here.)

        Raises:
            ValueError: No single EMA hook, or the file cannot be written.
        """
        if self.weights == "ema":
            self._ema_hook(trainer)
        problem = next((message for _, message in _suffix_problem(self.path)), None)
        if problem is None and one_process():  # under a launcher a rank alone must not refuse (see one_process)
            problem = file_problem(self._target(trainer))
        if problem is not None:
            raise ValueError(f"ExportHook path: {problem}")

    def _target(self, trainer: TrainerView) -> Path:
        """The file written: ``path``, under the workspace when relative."""
        return self.path if self.path.is_absolute() or trainer.workspace is None else trainer.workspace / self.path

    def _ema_hook(self, trainer: TrainerView) -> EmaHook:
        """The run's one EMA hook."""
        from trainloop.hooks.ema import EmaHook

        averaged = [hook for hook in trainer.hooks if isinstance(hook, EmaHook)]
        if len(averaged) != 1:
            raise ValueError(f"ExportHook weights='ema' needs exactly one EmaHook, found {len(averaged)}")
        return averaged[0]

    def on_after_train(self, trainer: TrainerView) -> None:
        """Write the file, if the run reached its end."""
        if trainer.error is not None or trainer.exit_requested:
            trainer.logger.info("ExportHook: the run did not reach its end; %s not written", self.path)
            return
        from trainloop.checkpoint.export import save_weights

        if self.weights == "ema":
            state = self._ema_hook(trainer).ema_model.module.state_dict()  # type: ignore[union-attr]
        else:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            state = get_model_state_dict(
                trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
            )
            if not state:  # cpu_offload leaves ranks other than 0 empty
                return
            state = _tied_as_in(trainer, state)
        if not is_rank_zero():
            return
        target = self._target(trainer)
        save_weights(
            state, target, step=trainer.step, settings_json=trainer.settings.model_dump_json(), weights=self.weights
        )
        self.written = target
        trainer.logger.info("Exported the %s weights of step %d to %s", self.weights, trainer.step, target)


def _suffix_problem(path: Path) -> list[HookProblem]:
    """The file is safetensors: under another suffix ``torch.load`` and ``init_from`` would take it for a torch file."""
    if path.suffix == ".safetensors":
        return []
    return [("path", f"{str(path)!r} ends in {path.suffix or 'no suffix'!r}: the export is a .safetensors file")]


def _tied_as_in(trainer: TrainerView, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with the model's tied keys sharing one tensor again, so the export records the tie.

    The gather copies them apart.
    """
    from trainloop.checkpoint.weights import tied_keys

    for key, owner in tied_keys(trainer.model).items():
        if key in state and owner in state and state[key].shape == state[owner].shape:
            state[key] = state[owner]
    return state
