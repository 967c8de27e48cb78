"""``wrap_model``: activation checkpointing, then DDP or FSDP2 (``fully_shard``), with validated options.

The trainer wraps nothing; a ``build_model`` calls this when it wants to::

    def build_model(self):
        return wrap_model(Net().to(self.device), "fsdp", shard_modules=(Block,), activation_checkpointing=Block)
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Annotated, Any, Literal

import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.utils.checkpoint import checkpoint

from trainloop.distributed.ranks import world_size

try:  # DeviceMesh is only importable where torch.distributed is built in
    from torch.distributed.device_mesh import DeviceMesh
except ImportError:  # pragma: no cover
    DeviceMesh = Any  # type: ignore[misc,assignment]

__all__ = ["DDPOptions", "FSDPOptions", "Strategy", "wrap_model"]

logger = logging.getLogger(__name__)

Strategy = Literal["auto", "ddp", "fsdp", "none"]
"""How ``wrap_model`` wraps: DDP, FSDP2 ``fully_shard``, nothing, or DDP when there are
two or more ranks (``"auto"``)."""



class DDPOptions(BaseModel):
    """``wrap_model`` options for ``strategy="ddp"`` (and ``"auto"``): DDP's own arguments.

    Only the options given are passed on, so DDP's defaults apply to the others.

    Attributes:
        broadcast_buffers: Broadcast rank 0's buffers at each forward (deprecated by torch 2.13
            in favour of ``forward_sync_buffers``, which older versions lack).
        bucket_cap_mb: Gradient bucket size in MiB (DDP's default if ``None``).
        find_unused_parameters: Allow parameters that get no gradient in some forward.
        gradient_as_bucket_view: Let gradients be views into the buckets (saves memory).
        static_graph: The set of used parameters never changes (enables optimisations).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, title="wrap_model DDP options")

    broadcast_buffers: StrictBool | None = None
    bucket_cap_mb: Annotated[float, Field(gt=0, strict=True, allow_inf_nan=False)] | None = None
    find_unused_parameters: StrictBool = False
    gradient_as_bucket_view: StrictBool = False
    static_graph: StrictBool = False


ShardPredicate = Callable[[nn.Module], bool]
ModuleRule = tuple[type[nn.Module], ...] | ShardPredicate
"""Which submodules an option applies to: module classes, or a predicate ``fn(module) -> bool``."""


def _one_class_is_a_tuple(value: Any) -> Any:
    # A class is callable too: without this it would be taken for a predicate.
    if isinstance(value, type):
        return (value,)
    if isinstance(value, list):
        return tuple(value)
    return value


def _matches(rule: ModuleRule, module: nn.Module) -> bool:
    if isinstance(rule, tuple):
        return isinstance(module, rule)
    return bool(rule(module))


class FSDPOptions(BaseModel):
    """``wrap_model`` options for ``strategy="fsdp"`` (FSDP2 ``fully_shard``).

    Attributes:
        shard_modules: Which submodules get their own ``fully_shard`` group (one all-gather and
            one reduce-scatter each), before the root gets the rest: module classes (e.g.
            ``(nn.TransformerEncoderLayer,)``) or a predicate ``fn(module) -> bool``. ``None``:
            the root alone (one group, no memory saving from layer-by-layer gathering).
        reshard_after_forward: ``fully_shard``'s: ``True`` frees gathered parameters after
            forward, ``False`` keeps them for backward, an int reshards to that smaller world
            size; ``None`` (torch's default) is ``True`` for the submodules, ``False`` for the root.
        mesh: The device mesh to shard over; every rank of the default group if ``None``.
        mp_policy: Mixed-precision policy (parameter, reduction and output dtypes).
        offload_policy: e.g. ``CPUOffloadPolicy()`` to keep sharded parameters on the CPU.
    """

    model_config = ConfigDict(
        extra="forbid", frozen=True, arbitrary_types_allowed=True, title="wrap_model FSDP options"
    )

    shard_modules: tuple[type[nn.Module], ...] | ShardPredicate | None = None
    reshard_after_forward: StrictBool | Annotated[int, Field(ge=2, strict=True)] | None = None
    mesh: DeviceMesh | None = None
    mp_policy: MixedPrecisionPolicy | None = None
    offload_policy: OffloadPolicy | None = None

    @field_validator("shard_modules", mode="before")
    @classmethod
    def _one_class_is_a_tuple(cls, value: Any) -> Any:
        return _one_class_is_a_tuple(value)

    @field_validator("shard_modules")
    @classmethod
    def _non_empty(cls, value: Any) -> Any:
        if isinstance(value, tuple) and not value:
            raise ValueError("give at least one module class, or None to shard the root alone")
        return value

    def matches(self, module: nn.Module) -> bool:
        """Whether ``module`` gets its own ``fully_shard`` group."""
        return self.shard_modules is not None and _matches(self.shard_modules, module)

    def fully_shard_kwargs(self) -> dict[str, Any]:
        """The keyword arguments for ``fully_shard``, leaving torch's defaults where unset."""
        names = ("reshard_after_forward", "mesh", "mp_policy", "offload_policy")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}


class _NoOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, title="wrap_model options for strategy='none'")


class _WrapArguments(BaseModel):
    # Validated by name, so an error names the parameter even when it was passed by position.
    model_config = ConfigDict(arbitrary_types_allowed=True, strict=True, title="wrap_model")

    model: nn.Module
    strategy: Strategy


_OPTIONS: dict[str, type[BaseModel]] = {
    "ddp": DDPOptions,
    "auto": DDPOptions,
    "fsdp": FSDPOptions,
    "none": _NoOptions,
}


def wrap_model(
    model: nn.Module,
    strategy: Strategy = "auto",
    *,
    activation_checkpointing: ModuleRule | type[nn.Module] | None = None,
    activation_checkpointing_every: int = 1,
    **options: Any,
) -> nn.Module:
    """Wrap ``model`` for data-parallel training; a one-liner for ``build_model``.

    Move the model to its device first (``model.to(self.device)``). Activation checkpointing, when
    asked for, is applied first, before sharding (and so before a ``torch.compile`` of the result):
    each checkpointed module's activations are dropped after its forward and recomputed in
    backward (``torch.utils.checkpoint``, non-reentrant, RNG state preserved), so losses and
    gradients are those of the model without it and its state-dict keys do not change.

    - ``"ddp"``: ``DistributedDataParallel(model, **options)`` (see ``DDPOptions``).
    - ``"fsdp"``: FSDP2. Every submodule that ``shard_modules`` matches is passed to
      ``fully_shard`` (innermost first), then the root; the model is changed in place and
      returned, its parameters now ``DTensor`` shards (see ``FSDPOptions``). For
      checkpoints, give the trainer ``state_dict_options=StateDictOptions(full_state_dict=True,
      cpu_offload=True)`` so rank 0 holds (and ``CheckpointingHook`` writes) full tensors.
    - ``"none"``: the model itself.
    - ``"auto"``: ``"ddp"`` with two or more ranks, else ``"none"`` (DDP options are
      validated either way, so one script runs alone and under torchrun).

    Args:
        model: The module to wrap, on its device.
        strategy: One of ``"auto"``, ``"ddp"``, ``"fsdp"``, ``"none"``.
        activation_checkpointing: Which submodules to checkpoint: a module class, a tuple of
            classes, or a predicate ``fn(module) -> bool``. Only the outermost matches count (a
            match inside a match is recomputed with it).
        activation_checkpointing_every: Checkpoint every n-th match: matches are counted from 1
            in module order, and those whose count is a multiple of n are checkpointed.
        **options: The chosen strategy's options (``DDPOptions`` or ``FSDPOptions``).

    Returns:
        The wrapped module.

    Raises:
        pydantic.ValidationError: An argument or option is invalid or does not belong to the
            strategy; the error names it.
        RuntimeError: ``"ddp"`` or ``"fsdp"`` without an initialised process group.
        ValueError: ``shard_modules`` or ``activation_checkpointing`` matched no submodule.
    """
    _WrapArguments(model=model, strategy=strategy)
    rule = _checkpointing_rule(activation_checkpointing, activation_checkpointing_every)
    settings = _OPTIONS[strategy].model_validate(options)
    if rule is not None:
        checkpoint_activations(model, rule, activation_checkpointing_every)
    if strategy == "auto":
        strategy = "ddp" if world_size() > 1 else "none"
    if strategy == "none":
        return model
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"wrap_model(strategy={strategy!r}) needs an initialised process group: call "
            "init_distributed() first (under torchrun), or use strategy='auto' to run alone"
        )
    if strategy == "ddp":
        assert isinstance(settings, DDPOptions)
        # Only what the user set: DDP's own defaults then hold (and no deprecated argument is passed).
        return nn.parallel.DistributedDataParallel(model, **settings.model_dump(exclude_unset=True))
    assert isinstance(settings, FSDPOptions)
    return _fully_shard(model, settings)


def _fully_shard(model: nn.Module, options: FSDPOptions) -> nn.Module:
    kwargs = options.fully_shard_kwargs()
    # named_modules() lists a parent before its children; reversed, every matched module is
    # sharded after the matched modules nested inside it, as fully_shard requires (bottom-up).
    groups = [m for _, m in reversed(list(model.named_modules())) if m is not model and options.matches(m)]
    if options.shard_modules is not None and not groups:
        raise ValueError(
            f"wrap_model shard_modules={options.shard_modules!r} matched no submodule of "
            f"{type(model).__name__}; pass None to shard the root alone"
        )
    for module in groups:
        fully_shard(module, **kwargs)
    fully_shard(model, **kwargs)
    logger.debug("fully_shard: %d submodule groups and the root", len(groups))
    return model


def _checkpointing_rule(value: Any, every: Any) -> ModuleRule | None:
    """``activation_checkpointing`` as a rule, checked with ``activation_checkpointing_every``.

    Raises:
        ValueError: Either is not what it can be (one line naming it and the value).
    """
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"wrap_model activation_checkpointing_every={every!r}: a whole number, at least 1")
    rule = _one_class_is_a_tuple(value)
    modules = isinstance(rule, tuple) and rule and all(isinstance(c, type) and issubclass(c, nn.Module) for c in rule)
    if rule is None or modules or (callable(rule) and not isinstance(rule, nn.Module | type)):
        return rule  # type: ignore[no-any-return]
    hint = " (a module itself: give its class)" if isinstance(rule, nn.Module) else ""
    raise ValueError(
        f"wrap_model activation_checkpointing={value!r}{hint}: a module class, a tuple of them, or a predicate "
        "fn(module) -> bool"
    )


def checkpoint_activations(model: nn.Module, rule: ModuleRule, every: int = 1) -> list[str]:
    """Checkpoint the activations of every ``every``-th outermost submodule of ``model`` that ``rule`` matches.

    The module keeps its class, parameters and state-dict keys: only its ``forward`` is replaced by
    one that runs the original under ``torch.utils.checkpoint`` (non-reentrant, so it composes with
    ``fully_shard``, DDP and ``torch.compile``; under ``no_grad`` it runs once and saves nothing).

    Returns:
        The names of the checkpointed submodules, in module order.

    Raises:
        ValueError: ``rule`` matched no submodule.
    """
    matched: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        inside = any(name.startswith(f"{outer}.") for outer, _ in matched)
        if module is not model and not inside and _matches(rule, module):
            matched.append((name, module))
    if not matched:
        raise ValueError(
            f"wrap_model activation_checkpointing={_describe(rule)} matched no submodule of {type(model).__name__}"
        )
    chosen = [(name, module) for count, (name, module) in enumerate(matched, start=1) if count % every == 0]
    for _, module in chosen:
        module.forward = functools.partial(checkpoint, module.forward, use_reentrant=False)
    logger.debug("activation checkpointing: %d of %d matched submodules", len(chosen), len(matched))
    return [name for name, _ in chosen]


def _describe(rule: ModuleRule) -> str:
    if isinstance(rule, tuple):
        return "(" + ", ".join(cls.__name__ for cls in rule) + ("," if len(rule) == 1 else "") + ")"
    return repr(rule)
