"""A trainer's full state as a state dict, and resuming from one: what a checkpoint holds.

``BaseTrainer.state_dict`` and ``BaseTrainer.load_state_dict`` call these; checkpoint hooks
call those.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from trainloop.core.data import InexactResumeWarning, batch_size_of
from trainloop.core.result import RefusedRunError
from trainloop.core.rng import get_rng_state, set_rng_state
from trainloop.core.run_state import SINGLE
from trainloop.distributed.ranks import gather_from_ranks, rank, world_size
from trainloop.settings import optimizer as components
from trainloop.utils import warn_user

if TYPE_CHECKING:
    from trainloop.core.data import EpochIterator
    from trainloop.core.run_state import RunState, TrainerView

#: The key of a plain DataLoader's saved position (the rest are StatefulDataLoader's own).
SAMPLER_POSITION = "trainloop_sampler_position"

__all__ = [
    "ChangedGlobalBatchError",
    "ChangedOptimizersError",
    "ChangedSettingsWarning",
    "global_batch_refusal",
    "load_training_state",
    "training_state",
]


class ChangedSettingsWarning(UserWarning):
    """A run resumes from a checkpoint made with different settings."""


class ChangedGlobalBatchError(RefusedRunError):
    """A run resumes with another global batch (ranks x batch size x accumulation) than the checkpoint's.

    Refused before the first step, as every ``RefusedRunError``.
    """


class ChangedOptimizersError(RefusedRunError):
    """A run resumes with other optimizers than the checkpoint's: other names, another order, another class.

    Refused before the first step, as every ``RefusedRunError``: one optimizer's state cannot load into another.
    """


def training_state(trainer: TrainerView, run: RunState) -> dict[str, Any]:
    """The full training state: model, optimizer, scheduler, grad scaler, step, and hooks'.

    ``run`` is the trainer's run state (its loop's), which holds the built components, the data
    position and the hooks' dispatch; ``trainer`` gives the settings and the state dict options.

    Model and optimizer go through ``torch.distributed.checkpoint.state_dict`` so DDP and FSDP
    models give the same layout as plain ones.
    """
    # Imported here: torch.distributed.checkpoint costs ~0.8 s to import, and many runs never save.
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    model, options = run.component("model"), trainer.state_dict_options
    data = run.data
    state_dict: dict[str, Any] = {}
    components: dict[str, Any] = {}  # the optimizers' and schedulers' states
    if trainer.settings.deepspeed is None:  # else the engine's partitions hold them (trainloop.checkpoint.deepspeed)
        optimizers, schedulers = run.optimizers, run.lr_schedulers
        optimizer_states = {
            name: get_optimizer_state_dict(model, opt, options=options) for name, opt in optimizers.items()
        }
        # Each optimizer's class, for a resume to name a mismatch: torch would load another class's
        # state silently and fail at the first step with a bare KeyError.
        classes = {name: _class_name(opt) for name, opt in optimizers.items()}
        scheduler_states = {name: scheduler.state_dict() for name, scheduler in schedulers.items()}
        state_dict["model"] = get_model_state_dict(model, options=options)
        # Several optimizers by name; one as it is (its name is SINGLE).
        components = (
            {"optimizers": optimizer_states, "optimizer_class": classes, "lr_scheduler": scheduler_states}
            if run.named_optimizers
            else {
                "optimizer": optimizer_states[SINGLE],
                "optimizer_class": classes[SINGLE],
                "lr_scheduler": scheduler_states.get(SINGLE),
            }
        )
    state_dict["training_state"] = {
        "step": run.step,
        "epoch": data.resume_epoch if data is not None else run.epoch,
        **components,
        "grad_scaler": run.component("grad_scaler").state_dict(),
        # Where the non-finite guard decides and how many updates it skipped in a row (fused optimizers).
        "device_verdicts": {name: verdict.state_dict() for name, verdict in run.verdicts.items()},
        # What resumes the run exactly, per rank (each rank has its own).
        "rng": gather_from_ranks(get_rng_state()),
        "data_loader": gather_from_ranks(_loader_state(run.component("data_loader"), data)),
        # What a resume on another number of ranks must keep.
        "global_batch": _global_batch(trainer, run),
        # JSON, never pickled: readable anywhere, and compared on resume.
        "settings": trainer.settings.model_dump_json(),
    }
    for fn in run.dispatch["on_state_dict"]:
        fn(trainer, state_dict)
    return state_dict


def load_training_state(trainer: TrainerView, run: RunState, state_dict: dict[str, Any]) -> None:
    """Restore into ``trainer`` and its run state what ``training_state`` returned."""
    saved = state_dict["training_state"]
    by_engine = trainer.settings.deepspeed is not None  # the engine loaded model, optimizer and lr scheduler itself
    if not by_engine:
        optimizer_states, classes, scheduler_states = _by_name(trainer, run, saved)
        for name, optimizer in trainer.optimizers.items():
            _check_optimizer_class(name if run.named_optimizers else None, optimizer, classes.get(name))
    _check_global_batch(trainer, run, saved.get("global_batch"))
    run.step = saved["step"]
    run.epoch = saved.get("epoch", 0)
    trainer.logger.debug("Resuming from step %d", run.step)  # the loader says it in one line: "Resumed from ..."
    trainer.grad_scaler.load_state_dict(saved["grad_scaler"])
    _restore_verdicts(run, saved.get("device_verdicts") or {})
    _restore_per_rank(trainer, run, saved)
    _warn_on_changed_settings(trainer, saved.get("settings"))
    if not by_engine:
        for name, scheduler in trainer.lr_schedulers.items():
            # The scheduler must load before the optimizer: loading it rewrites the optimizer's
            # lr with its own (pytorch/pytorch#119168).
            scheduler.load_state_dict(scheduler_states[name])
        _load_model_and_optimizers(trainer, state_dict["model"], optimizer_states)
    for fn in run.dispatch["on_load_state_dict"]:
        fn(trainer, state_dict)


def _by_name(
    trainer: TrainerView, run: RunState, saved: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, str | None], dict[str, Any]]:
    """The checkpoint's optimizer states, classes and scheduler states by optimizer name.

    Raises:
        ChangedOptimizersError: The checkpoint's optimizers are not this run's (other names, another order, or one
            where there are several).
    """
    now = list(trainer.optimizers) if run.named_optimizers else None
    then = list(saved["optimizers"]) if "optimizers" in saved else None
    if now != then:
        def described(names: list[str] | None) -> str:
            return f"optimizers {', '.join(names)}" if names is not None else "one optimizer"

        raise ChangedOptimizersError(
            f"the checkpoint holds the state of {described(then)}, and this run builds {described(now)}: "
            "resume with the same optimizers, or start fresh (another workspace, or CheckpointingHook(load=None))"
        )
    if then is None:
        return (
            {SINGLE: saved["optimizer"]},
            {SINGLE: saved.get("optimizer_class")},
            {SINGLE: saved.get("lr_scheduler")},
        )
    return saved["optimizers"], saved.get("optimizer_class") or {}, saved.get("lr_scheduler") or {}


def _load_model_and_optimizers(
    trainer: TrainerView, model_state: dict[str, Any], optimizer_states: dict[str, dict[str, Any]]
) -> None:
    """Load the model's and the optimizers' states (saved by ``get_state_dict``: keyed by parameter names).

    A plain or DDP model's optimizer state is renumbered by parameter and loaded directly:
    torch's ``set_state_dict`` would first run a dummy optimizer step to create the state it
    then overwrites (0.7 s at 42M parameters with AdamW). Sharded models keep torch's path.
    """
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    model, options = trainer.model, trainer.state_dict_options
    set_model_state_dict(model, model_state, options=options)
    for name, optimizer in trainer.optimizers.items():
        by_index = _optimizer_state_by_index(trainer, optimizer, optimizer_states[name])
        if by_index is None:
            set_optimizer_state_dict(model, optimizer, optimizer_states[name], options=options)
        else:
            optimizer.load_state_dict(by_index)


def _optimizer_state_by_index(trainer: TrainerView, optimizer: Any, saved: dict[str, Any]) -> dict[str, Any] | None:
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
    if len(saved_groups) != len(optimizer.param_groups):
        return None
    for group, saved_group in zip(optimizer.param_groups, saved_groups, strict=True):
        named = [names.get(param) for param in group["params"]]
        if None in named or named != list(saved_group["params"]):
            return None
        groups.append({**saved_group, "params": list(range(index, index + len(named)))})
        state.update({index + i: saved_state[fqn] for i, fqn in enumerate(named) if fqn in saved_state})
        index += len(named)
    return {"state": state, "param_groups": groups}


def _class_name(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _check_optimizer_class(name: str | None, optimizer: Any, saved: str | None) -> None:
    """Refuse optimizer state saved by another optimizer class (checkpoints that record it).

    Raises:
        ChangedOptimizersError: The classes differ; the message names both (and the optimizer, one of several).
    """
    now = _class_name(optimizer)
    if saved is not None and saved != now:
        which = f"optimizer {name!r}" if name is not None else "optimizer"
        raise ChangedOptimizersError(
            f"the checkpoint's {which} state was saved by {saved}, and this run's {which} is "
            f"{now}: one cannot load the other's state; build the same optimizer to resume, or "
            "start fresh (another workspace, or CheckpointingHook(load=None))"
        )


def _restore_verdicts(run: RunState, saved: dict[str, Any]) -> None:
    """Restore the device verdicts' states, or keep them for the verdicts made in ``restoring``."""
    if not run.verdicts:
        run.restored_verdicts = saved
        return
    for name, verdict in run.verdicts.items():
        if name in saved:
            verdict.load_state_dict(saved[name])


def _restore_per_rank(trainer: TrainerView, run: RunState, saved: dict[str, Any]) -> None:
    """Restore this rank's generators and data position, if saved for as many ranks.

    On another number of ranks the generators are left as seeded, and a plain ``DataLoader``'s
    position goes on from any rank's (see :mod:`trainloop.core.data`).
    """
    rngs, loaders = saved.get("rng"), saved.get("data_loader")
    this_rank, world = rank(), world_size()
    if rngs is not None and len(rngs) != world:
        trainer.logger.warning(
            "The checkpoint holds random states of %d ranks and this run has %d: they are not restored, so "
            "what draws random numbers (dropout, augmentation) draws other ones than an unbroken run", len(rngs), world,
        )
    elif rngs is not None:
        if run.data is None:
            run.restored_rng = rngs[this_rank]  # applied once the data iterator exists
        else:
            set_rng_state(rngs[this_rank])
    if loaders is None or all(state is None for state in loaders):
        return
    same_ranks = len(loaders) == world
    state = loaders[this_rank] if same_ranks else next(state for state in loaders if state is not None)
    if state is None:
        return
    if SAMPLER_POSITION in state:  # a plain DataLoader's (see trainloop.core.data)
        position = state[SAMPLER_POSITION]
        # Another rank's epoch cannot be replayed here: only its global part goes on.
        run.restored_position = position if same_ranks else {**position, "epoch_start": None}
        return
    if not same_ranks:
        warn_user(
            f"resuming on {world} rank{'s' * (world != 1)} from a checkpoint of {len(loaders)}: the data loader's "
            f"saved state ({type(trainer.data_loader).__name__}'s own) is per rank, so it is not restored and epoch "
            f"{saved.get('epoch', 0)} starts over from its beginning; a DataLoader over a map-style dataset with a "
            "DistributedSampler resumes exactly on any number of ranks",
            InexactResumeWarning,
        )
        return
    # A saved position comes from a stateful loader (StatefulDataLoader), which the
    # trainer's declared type, an Iterable, does not promise.
    loader: Any = trainer.data_loader
    loader.load_state_dict(state)


def _global_batch(trainer: TrainerView, run: RunState) -> dict[str, Any]:
    """The ranks, each one's batch size (``None`` if the loader does not say) and the accumulation."""
    return {
        "ranks": world_size(),
        "batch_size": batch_size_of(run.component("data_loader")),
        "accumulation": trainer.run_length.accumulation,
    }


def _check_global_batch(trainer: TrainerView, run: RunState, saved: dict[str, Any] | None) -> None:
    """Refuse a resume whose global batch differs from the checkpoint's, when both loaders say their batch size.

    Raises:
        ChangedGlobalBatchError: The global batches differ; the message names both and what gives the checkpoint's.
    """
    refusal = None if saved is None else global_batch_refusal(saved, _global_batch(trainer, run))
    if refusal is not None:
        raise ChangedGlobalBatchError(refusal)


def global_batch_refusal(then: dict[str, Any], now: dict[str, Any]) -> str | None:
    """Why a run of global batch ``now`` cannot resume a checkpoint of ``then`` (both as ``global_batch`` records).

    ``None`` when they are equal, or when either loader's batch size is unknown.
    """
    if then.get("batch_size") is None or now.get("batch_size") is None:
        return None
    then_total, now_total = (b["ranks"] * b["batch_size"] * b["accumulation"] for b in (then, now))
    if then_total == now_total:
        return None
    ranks, size, accumulation = now["ranks"], now["batch_size"], now["accumulation"]
    on = f"{ranks} rank{'s' * (ranks != 1)}"
    if then_total % ranks:
        fix = f"which {on} cannot split evenly: resume on a number of ranks that divides {then_total}"
    else:
        fixes = []
        if then_total % (ranks * size) == 0:
            fixes.append(f"set gradient_accumulation_steps={then_total // (ranks * size)}")
        if then_total % (ranks * accumulation) == 0:
            fixes.append(f"build the data loader with batch_size={then_total // (ranks * accumulation)}")
        products = f"choose a batch size and gradient_accumulation_steps whose product is {then_total // ranks}"
        fix = f"so on {on} {' or '.join(fixes) if fixes else products}"
    return (
        f"the checkpoint's global batch is {then_total} ({_terms(then)}) and this run's is {now_total} "
        f"({_terms(now)}): a resume must keep the global batch, {fix}, or start fresh (another workspace, or "
        "CheckpointingHook(load=None))"
    )


def _terms(batch: dict[str, Any]) -> str:
    ranks = batch["ranks"]
    return (f"{ranks} rank{'s' * (ranks != 1)} x batch size {batch['batch_size']} x "
            f"gradient_accumulation_steps {batch['accumulation']}")


def _warn_on_changed_settings(trainer: TrainerView, saved: str | None) -> None:
    if saved is None:
        return
    then = json.loads(saved)
    now = json.loads(trainer.settings.model_dump_json())
    changed = sorted(k for k in then.keys() | now.keys() if then.get(k) != now.get(k))
    if changed:
        warn_user(
            f"resuming with settings that differ from the checkpoint's: {', '.join(changed)}",
            ChangedSettingsWarning,
        )
    note = components.describe_schedule_change(then, trainer.settings, trainer.step)
    if note is not None:  # what a declared schedule does now, beyond "settings differ"
        warn_user(note, ChangedSettingsWarning)
    # The optimizer state loaded below carries the checkpoint's param groups (lr, betas, weight
    # decay): a changed declaration would otherwise look applied and not be.
    for which, fields in _changed_optimizer_fields(then, now).items():
        warn_user(
            f"{'; '.join(fields)}: the checkpoint's {which} state is restored, its learning rates and "
            "other param-group values included, so the changed optimizer settings take effect only in a "
            "fresh run",
            ChangedSettingsWarning,
        )


def _changed_optimizer_fields(then: dict[str, Any], now: dict[str, Any]) -> dict[str, list[str]]:
    """Per declared optimizer both settings have, its changed fields as ``optimizers.head.lr 0.01 -> 0.02``."""
    declared: dict[str, tuple[str, Any, Any]] = {}
    if then.get("optimizer") is not None and now.get("optimizer") is not None:
        declared["optimizer"] = ("optimizer", then["optimizer"], now["optimizer"])
    for name, spec in (now.get("optimizers") or {}).items():
        before = (then.get("optimizers") or {}).get(name)
        if before is not None:
            declared[f"optimizer {name!r}"] = (f"optimizers.{name}", before, spec)
    changes = {}
    for which, (where, before, after) in declared.items():
        fields = [
            f"{where}.{key} {before.get(key)!r} -> {after.get(key)!r}"
            for key in sorted(before.keys() | after.keys())
            if before.get(key) != after.get(key)
        ]
        if fields:
            changes[which] = fields
    return changes


def _loader_state(loader: Any, data: EpochIterator | None) -> Any:
    """The loader's position, or ``None`` when it has none to report.

    A ``StatefulDataLoader`` reports its own; a plain ``DataLoader`` with a sampler, where it is in its epoch.
    """
    state_dict = getattr(loader, "state_dict", None)
    if callable(state_dict):
        return state_dict()
    position = data.position() if data is not None else None
    return None if position is None else {SAMPLER_POSITION: position}
