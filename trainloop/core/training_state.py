"""A trainer's full state as a state dict, and resuming from one: what a checkpoint holds.

``BaseTrainer.state_dict`` and ``BaseTrainer.load_state_dict`` call these; checkpoint hooks
call those.
"""

from __future__ import annotations

import json
import warnings
from typing import TYPE_CHECKING, Any

from trainloop.core.rng import get_rng_state, set_rng_state
from trainloop.distributed.ranks import gather_from_ranks, rank, world_size
from trainloop.settings import optimizer as components

if TYPE_CHECKING:
    from trainloop.core.data import EpochIterator
    from trainloop.core.run_state import RunState, TrainerView

#: The key of a plain DataLoader's saved position (the rest are StatefulDataLoader's own).
SAMPLER_POSITION = "trainloop_sampler_position"

__all__ = ["ChangedSettingsWarning", "load_training_state", "training_state"]


class ChangedSettingsWarning(UserWarning):
    """A run resumes from a checkpoint made with different settings."""


def training_state(trainer: TrainerView, run: RunState) -> dict[str, Any]:
    """The full training state: model, optimizer, scheduler, grad scaler, step, and hooks'.

    ``run`` is the trainer's run state (its loop's), which holds the data position and the
    hooks' dispatch.

    Model and optimizer go through ``torch.distributed.checkpoint.state_dict`` so DDP and FSDP
    models give the same layout as plain ones.
    """
    # Imported here: torch.distributed.checkpoint costs ~0.8 s to import, and many runs never save.
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(
        trainer.model, trainer.optimizer, options=trainer.state_dict_options
    )
    data = run.data
    state_dict: dict[str, Any] = {
        "model": model_state,
        "training_state": {
            "step": run.step,
            "epoch": data.resume_epoch if data is not None else run.epoch,
            "optimizer": optimizer_state,
            # Its class, for a resume to name a mismatch: torch would load another class's
            # state silently and fail at the first step with a bare KeyError.
            "optimizer_class": _class_name(trainer.optimizer),
            "lr_scheduler": trainer.lr_scheduler.state_dict() if trainer.lr_scheduler else None,
            "grad_scaler": trainer.grad_scaler.state_dict(),
            # What resumes the run exactly, per rank (each rank has its own).
            "rng": gather_from_ranks(get_rng_state()),
            "data_loader": gather_from_ranks(_loader_state(trainer.data_loader, data)),
            # JSON, never pickled: readable anywhere, and compared on resume.
            "settings": trainer.settings.model_dump_json(),
        },
    }
    for fn in run.dispatch["on_state_dict"]:
        fn(trainer, state_dict)
    return state_dict


def load_training_state(trainer: TrainerView, run: RunState, state_dict: dict[str, Any]) -> None:
    """Restore into ``trainer`` and its run state what ``training_state`` returned."""
    saved = state_dict["training_state"]
    _check_optimizer_class(trainer, saved.get("optimizer_class"))
    run.step = saved["step"]
    run.epoch = saved.get("epoch", 0)
    trainer.logger.debug("Resuming from step %d", run.step)  # the loader says it in one line: "Resumed from ..."
    if trainer.lr_scheduler is not None:
        # The scheduler must load before the optimizer: loading it rewrites the optimizer's
        # lr with its own (pytorch/pytorch#119168).
        trainer.lr_scheduler.load_state_dict(saved["lr_scheduler"])
    trainer.grad_scaler.load_state_dict(saved["grad_scaler"])
    _restore_per_rank(trainer, run, saved)
    _warn_on_changed_settings(trainer, saved.get("settings"))
    _load_model_and_optimizer(trainer, state_dict["model"], saved["optimizer"])
    for fn in run.dispatch["on_load_state_dict"]:
        fn(trainer, state_dict)


def _load_model_and_optimizer(
    trainer: TrainerView, model_state: dict[str, Any], optimizer_state: dict[str, Any]
) -> None:
    """Load the model's and the optimizer's states (saved by ``get_state_dict``: keyed by names).

    A plain or DDP model's optimizer state is renumbered by parameter and loaded directly:
    torch's ``set_state_dict`` would first run a dummy optimizer step to create the state it
    then overwrites (0.7 s at 42M parameters with AdamW). Sharded models keep torch's path.
    """
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    by_index = _optimizer_state_by_index(trainer, optimizer_state)
    if by_index is None:
        set_state_dict(
            trainer.model,
            trainer.optimizer,
            model_state_dict=model_state,
            optim_state_dict=optimizer_state,
            options=trainer.state_dict_options,
        )
        return
    set_model_state_dict(trainer.model, model_state, options=trainer.state_dict_options)
    trainer.optimizer.load_state_dict(by_index)


def _optimizer_state_by_index(trainer: TrainerView, saved: dict[str, Any]) -> dict[str, Any] | None:
    """``saved`` in ``Optimizer.state_dict``'s own numbering, or ``None`` where torch must do it.

    ``saved`` names parameters as ``get_state_dict`` names them. ``None`` leaves it to torch's ``set_state_dict``: a
    sharded model (FSDP, DTensor parameters), flattened options, or a layout that does not match.
    """
    from torch.distributed.checkpoint.state_dict import _get_fqns
    from torch.distributed.tensor import DTensor

    options = trainer.state_dict_options
    if options is not None and (options.flatten_optimizer_state_dict or not options.strict):
        return None
    if any(isinstance(p, DTensor) for p in trainer.model.parameters()) or any(
        type(m).__name__ == "FullyShardedDataParallel" for m in trainer.model.modules()
    ):
        return None
    names: dict[Any, str] = {}
    for key, param in trainer.model.named_parameters():
        fqns = _get_fqns(trainer.model, key)
        if len(fqns) != 1:
            return None
        names[param] = next(iter(fqns))
    groups, state, index = [], {}, 0
    saved_groups, saved_state = saved.get("param_groups", []), saved.get("state", {})
    if len(saved_groups) != len(trainer.optimizer.param_groups):
        return None
    for group, saved_group in zip(trainer.optimizer.param_groups, saved_groups, strict=True):
        named = [names.get(param) for param in group["params"]]
        if None in named or named != list(saved_group["params"]):
            return None
        groups.append({**saved_group, "params": list(range(index, index + len(named)))})
        state.update({index + i: saved_state[fqn] for i, fqn in enumerate(named) if fqn in saved_state})
        index += len(named)
    return {"state": state, "param_groups": groups}


def _class_name(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _check_optimizer_class(trainer: TrainerView, saved: str | None) -> None:
    """Refuse optimizer state saved by another optimizer class (checkpoints that record it).

    Raises:
        ValueError: The classes differ; the message names both.
    """
    now = _class_name(trainer.optimizer)
    if saved is not None and saved != now:
        raise ValueError(
            f"the checkpoint's optimizer state was saved by {saved}, and this run's optimizer is "
            f"{now}: one cannot load the other's state; build the same optimizer to resume, or "
            "start fresh (another workspace, or CheckpointingHook(load=None))"
        )


def _restore_per_rank(trainer: TrainerView, run: RunState, saved: dict[str, Any]) -> None:
    """Restore this rank's generators and data position, if saved for as many ranks."""
    rngs, loaders = saved.get("rng"), saved.get("data_loader")
    this_rank, world = rank(), world_size()
    if rngs is None or len(rngs) != world:
        if rngs is not None:
            trainer.logger.warning(
                "The checkpoint holds random states of %d ranks and this run has %d: they are "
                "not restored, so the resumed run is not an exact continuation", len(rngs), world,
            )
        return
    if run.data is None:
        run.restored_rng = rngs[this_rank]  # applied once the data iterator exists
    else:
        set_rng_state(rngs[this_rank])
    if loaders is not None and loaders[this_rank] is not None:
        if SAMPLER_POSITION in loaders[this_rank]:  # a plain DataLoader's (see trainloop.core.data_position)
            run.restored_position = loaders[this_rank][SAMPLER_POSITION]
            return
        # A saved position comes from a stateful loader (StatefulDataLoader), which the
        # trainer's declared type, an Iterable, does not promise.
        loader: Any = trainer.data_loader
        loader.load_state_dict(loaders[this_rank])


def _warn_on_changed_settings(trainer: TrainerView, saved: str | None) -> None:
    if saved is None:
        return
    then = json.loads(saved)
    now = json.loads(trainer.settings.model_dump_json())
    changed = sorted(k for k in then.keys() | now.keys() if then.get(k) != now.get(k))
    if changed:
        warnings.warn(
            f"resuming with settings that differ from the checkpoint's: {', '.join(changed)}",
            ChangedSettingsWarning,
            stacklevel=3,
        )
    note = components.describe_schedule_change(then, trainer.settings, trainer.step)
    if note is not None:  # what a declared schedule does now, beyond "settings differ"
        warnings.warn(note, ChangedSettingsWarning, stacklevel=3)
    if "optimizer" in changed and now.get("optimizer") is not None:
        # The optimizer state loaded below carries the checkpoint's param groups (lr, betas,
        # weight decay): a changed declaration would otherwise look applied and not be.
        warnings.warn(
            "optimizer: the checkpoint's optimizer state is restored, its learning rates and other "
            "param-group values included, so the changed optimizer settings take effect only in a "
            "fresh run",
            ChangedSettingsWarning,
            stacklevel=3,
        )


def _loader_state(loader: Any, data: EpochIterator | None) -> Any:
    """The loader's position, or ``None`` when it has none to report.

    A ``StatefulDataLoader`` reports its own; a plain ``DataLoader`` with a sampler, where it is in its epoch.
    """
    state_dict = getattr(loader, "state_dict", None)
    if callable(state_dict):
        return state_dict()
    position = data.position() if data is not None else None
    return None if position is None else {SAMPLER_POSITION: position}
