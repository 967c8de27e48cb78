"""A trainer's full state as a state dict, and resuming from one: what a checkpoint holds.

``BaseTrainer.state_dict`` and ``BaseTrainer.load_state_dict`` call these; checkpoint hooks
call those.
"""

from __future__ import annotations

import json
import warnings
from typing import TYPE_CHECKING, Any

from trainloop.distributed.ranks import gather_from_ranks, rank, world_size
from trainloop.rng import get_rng_state, set_rng_state
from trainloop.settings import optimizer as components

if TYPE_CHECKING:
    from trainloop.data import EpochIterator
    from trainloop.trainer import BaseTrainer

#: The key of a plain DataLoader's saved position (the rest are StatefulDataLoader's own).
SAMPLER_POSITION = "trainloop_sampler_position"

__all__ = ["ChangedSettingsWarning", "load_training_state", "training_state"]


class ChangedSettingsWarning(UserWarning):
    """A run resumes from a checkpoint made with different settings."""


def training_state(trainer: BaseTrainer) -> dict[str, Any]:
    """The full training state: model, optimizer, scheduler, grad scaler, step, and hooks'.

    Model and optimizer go through ``torch.distributed.checkpoint.state_dict`` so DDP and FSDP
    models give the same layout as plain ones.
    """
    # Imported here: torch.distributed.checkpoint costs ~0.8 s to import, and many runs never save.
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(
        trainer.model, trainer.optimizer, options=trainer.state_dict_options
    )
    data = trainer._loop.data
    state_dict: dict[str, Any] = {
        "model": model_state,
        "training_state": {
            "step": trainer.step,
            "epoch": data.resume_epoch if data is not None else trainer.epoch,
            "optimizer": optimizer_state,
            "lr_scheduler": trainer.lr_scheduler.state_dict() if trainer.lr_scheduler else None,
            "grad_scaler": trainer.grad_scaler.state_dict(),
            # What resumes the run exactly, per rank (each rank has its own).
            "rng": gather_from_ranks(get_rng_state()),
            "data_loader": gather_from_ranks(_loader_state(trainer.data_loader, data)),
            # JSON, never pickled: readable anywhere, and compared on resume.
            "settings": trainer.settings.model_dump_json(),
        },
    }
    for fn in trainer._dispatch["on_state_dict"]:
        fn(trainer, state_dict)
    return state_dict


def load_training_state(trainer: BaseTrainer, state_dict: dict[str, Any]) -> None:
    """Restore into ``trainer`` what ``training_state`` returned."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    saved = state_dict["training_state"]
    trainer.step = saved["step"]
    trainer.epoch = saved.get("epoch", 0)
    trainer.logger.info("Resuming from step %d", trainer.step)
    if trainer.lr_scheduler is not None:
        # The scheduler must load before the optimizer: loading it rewrites the optimizer's
        # lr with its own (pytorch/pytorch#119168).
        trainer.lr_scheduler.load_state_dict(saved["lr_scheduler"])
    trainer.grad_scaler.load_state_dict(saved["grad_scaler"])
    _restore_per_rank(trainer, saved)
    _warn_on_changed_settings(trainer, saved.get("settings"))
    set_state_dict(
        trainer.model,
        trainer.optimizer,
        model_state_dict=state_dict["model"],
        optim_state_dict=saved["optimizer"],
        options=trainer.state_dict_options,
    )
    for fn in trainer._dispatch["on_load_state_dict"]:
        fn(trainer, state_dict)


def _restore_per_rank(trainer: BaseTrainer, saved: dict[str, Any]) -> None:
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
    if trainer._loop.data is None:
        trainer._loop.restored_rng = rngs[this_rank]  # applied once the data iterator exists
    else:
        set_rng_state(rngs[this_rank])
    if loaders is not None and loaders[this_rank] is not None:
        if SAMPLER_POSITION in loaders[this_rank]:  # a plain DataLoader's (see trainloop.data_position)
            trainer._loop.restored_position = loaders[this_rank][SAMPLER_POSITION]
            return
        # A saved position comes from a stateful loader (StatefulDataLoader), which the
        # trainer's declared type, an Iterable, does not promise.
        loader: Any = trainer.data_loader
        loader.load_state_dict(loaders[this_rank])


def _warn_on_changed_settings(trainer: BaseTrainer, saved: str | None) -> None:
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
    """The loader's position when it can report one (``StatefulDataLoader``), or where a plain
    ``DataLoader`` with a sampler is in its epoch; else ``None``."""
    state_dict = getattr(loader, "state_dict", None)
    if callable(state_dict):
        return state_dict()
    position = data.position() if data is not None else None
    return None if position is None else {SAMPLER_POSITION: position}
