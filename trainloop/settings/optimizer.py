"""The optimizer and the learning-rate schedule, declared in settings.

An optimizer is any ``torch.optim`` optimizer, named as torch names it, with its constructor's
keyword arguments beside the name, and optionally which parameters get no weight decay::

    {"name": "AdamW", "lr": 3e-4, "betas": [0.9, 0.95], "weight_decay": 0.1,
     "no_weight_decay": ["bias", "norm"]}

A schedule is constant, linear or cosine, with an optional linear warmup, scaling each param
group's own learning rate::

    {"name": "cosine", "warmup_steps": 500, "final_lr_ratio": 0.1}

``build_optimizer`` and ``build_lr_scheduler`` turn them into torch objects. Both
settings models are frozen and strict, produce a JSON Schema and round-trip through JSON. The
schedule lives in ``trainloop.settings.schedule``; its names are re-exported here.
"""

from __future__ import annotations

import difflib
import inspect
import re
import types
import typing
from collections.abc import Collection
from functools import cache
from typing import TYPE_CHECKING, Annotated, Any, Literal, Union

import torch
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    RootModel,
    create_model,
    model_validator,
)
from torch import nn

from trainloop.settings.schedule import (
    LR_SCHEDULES,
    LrScheduleSettings,
    build_lr_scheduler,
    describe_schedule_change,
    lr_factor,
)
from trainloop.settings.types import StrictBool

__all__ = [
    "LR_SCHEDULES",
    "OPTIMIZERS",
    "OPTIMIZER_NAME",
    "LrScheduleSettings",
    "OptimizerSettings",
    "build_lr_scheduler",
    "build_optimizer",
    "describe_schedule_change",
    "lr_factor",
    "module_problem",
    "optimizer_names_problem",
]

# -- optimizers ----------------------------------------------------------------------------------


def _discover_optimizers() -> dict[str, type[torch.optim.Optimizer]]:
    found = {}
    for name in dir(torch.optim):
        obj = getattr(torch.optim, name)
        if inspect.isclass(obj) and issubclass(obj, torch.optim.Optimizer) and obj is not torch.optim.Optimizer:
            found[name] = obj
    return dict(sorted(found.items()))


#: Every optimizer class of ``torch.optim``, by its class name.
OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = _discover_optimizers()

#: What ``no_weight_decay`` can name: see ``OptimizerSettings``.
NoWeightDecayRule = Literal["bias", "norm", "embedding"]

_StrictFloat = Annotated[float, Field(strict=True, allow_inf_nan=False)]
_StrictInt = Annotated[int, Field(strict=True)]
_StrictStr = Annotated[str, Field(strict=True)]

# torch's own normalisation layers; a model's own (an ``RMSNorm`` in the user's code) is
# recognised by its class name instead, see ``_is_norm``.
_NORM_TYPES: tuple[type[nn.Module], ...] = (
    nn.LayerNorm,
    nn.RMSNorm,
    nn.GroupNorm,
    nn.LocalResponseNorm,
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    nn.SyncBatchNorm,
    nn.LazyBatchNorm1d,
    nn.LazyBatchNorm2d,
    nn.LazyBatchNorm3d,
    nn.InstanceNorm1d,
    nn.InstanceNorm2d,
    nn.InstanceNorm3d,
    nn.LazyInstanceNorm1d,
    nn.LazyInstanceNorm2d,
    nn.LazyInstanceNorm3d,
)
_EMBEDDING_TYPES: tuple[type[nn.Module], ...] = (nn.Embedding, nn.EmbeddingBag)
# Compared with ``is``, in this order: a constructor's scalar annotation and its strict settings type.
_STRICT_SCALARS: tuple[tuple[type, Any], ...] = (
    (float, _StrictFloat),
    (bool, StrictBool),
    (int, _StrictInt),
    (str, _StrictStr),
)


def _settings_type(annotation: Any) -> Any:
    """The strict, JSON-able counterpart of a constructor annotation, or ``None`` if it has none.

    Tensors are dropped from unions (``lr: float | Tensor`` becomes a strict float): a settings
    file holds numbers. Containers stay lax so a JSON/YAML list is taken for a tuple.
    """
    for python_type, strict in _STRICT_SCALARS:
        if annotation is python_type:
            return strict
    if annotation is None or annotation is type(None):
        return type(None)
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is Literal:
        return annotation
    if origin in (Union, types.UnionType):
        return _settings_union(args)
    if origin is tuple:
        return _settings_tuple(args)
    return None


def _settings_union(args: tuple[Any, ...]) -> Any:
    """The settings type of a union of ``args`` (tensors dropped), or ``None`` if a member has none."""
    mapped = [_settings_type(arg) for arg in args if arg is not torch.Tensor]
    if not mapped or any(m is None for m in mapped):
        return None
    return mapped[0] if len(mapped) == 1 else Union[tuple(mapped)]  # noqa: UP007


def _settings_tuple(args: tuple[Any, ...]) -> Any:
    """The settings type of ``tuple[args]``, or ``None`` if an item has none."""
    if len(args) == 2 and args[1] is Ellipsis:
        item = _settings_type(args[0])
        return None if item is None else tuple[item, ...]  # type: ignore[valid-type]
    mapped = [_settings_type(arg) for arg in args]
    if not mapped or any(m is None for m in mapped):
        return None
    return tuple[tuple(mapped)]  # type: ignore[misc]


class _OptimizerArgs(BaseModel):
    """Base of each optimizer's settings model: its name and constructor arguments."""

    # Descriptions are given as Field(description=...), not attribute docstrings: reading those
    # makes pydantic inspect the source of every frame on the import stack for each of the ~15
    # models derived from this base, which cost seconds at `import trainloop`.
    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)

    name: str = Field(description="The ``torch.optim`` optimizer's class name.")
    module: Annotated[str, Field(min_length=1)] | None = Field(
        None,
        description=(
            "The submodule whose parameters it optimizes, as ``model.get_submodule`` names it "
            '(``"generator"``, ``"encoder.layers"``); by default the whole model.'
        ),
    )

    @model_validator(mode="before")
    @classmethod
    def _known_arguments(cls, data: Any) -> Any:
        # pydantic's own "Extra inputs are not permitted" does not say what is permitted.
        if isinstance(data, dict):
            unknown = sorted(str(key) for key in data if key not in cls.model_fields)
            if unknown:
                names = [name for name in cls.model_fields if name != "name"]
                close = [match for key in unknown for match in difflib.get_close_matches(key, names, n=1)]
                hint = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
                raise ValueError(
                    f"unknown argument(s) {', '.join(map(repr, unknown))} for {cls._optimizer_name()}{hint}; "
                    f"valid arguments: {', '.join(names)}"
                )
        return data

    @model_validator(mode="after")
    def _constructor_accepts(self) -> _OptimizerArgs:
        # The constructor holds the value checks (lr >= 0, betas in [0, 1)...): run it once on a
        # throwaway 2-D parameter (Muon takes only matrices) so a bad value fails with the
        # settings, not after the model is built.
        cls = OPTIMIZERS[self.name]
        kwargs = self.kwargs()
        error = _constructor_error(cls, kwargs)
        if error is None:
            return self
        # Name the argument(s) at fault: those whose own default makes the constructor succeed.
        defaults = type(self).model_fields
        culprits = [
            key
            for key in self.model_fields_set & kwargs.keys()
            if _constructor_error(cls, {**kwargs, key: defaults[key].default}) is None
        ]
        where = f"{', '.join(sorted(culprits))}: " if culprits else ""
        raise ValueError(f"{where}{self.name} rejected its arguments: {error}")

    @classmethod
    def _optimizer_name(cls) -> str:
        name: str = typing.get_args(cls.model_fields["name"].annotation)[0]
        return name

    def kwargs(self) -> dict[str, Any]:
        """The optimizer constructor's keyword arguments (every declared argument)."""
        return {
            name: getattr(self, name)
            for name in type(self).model_fields
            if name not in ("name", "module", "no_weight_decay")
        }


class _DecayOptimizerArgs(_OptimizerArgs):
    """Base of the settings of an optimizer that takes ``weight_decay``."""

    no_weight_decay: tuple[NoWeightDecayRule, ...] = Field(
        (),
        description=(
            'Parameters that get no weight decay (their own param group, ``"no_decay"``): ``"bias"`` '
            '(parameters named ``bias`` or ``*_bias``), ``"norm"`` (every parameter of a normalisation '
            "layer: torch's LayerNorm, RMSNorm, GroupNorm, BatchNorm*, InstanceNorm*, and any module whose "
            'class name ends in ``Norm``), ``"embedding"`` (``nn.Embedding`` / ``nn.EmbeddingBag``).'
        ),
    )


def _constructor_error(cls: type[torch.optim.Optimizer], kwargs: dict[str, Any]) -> str | None:
    probe = nn.Parameter(torch.zeros(1, 1))
    try:
        cls([probe], **kwargs)
    except (ValueError, TypeError, RuntimeError) as error:
        return str(error)
    return None


@cache
def _optimizer_args_model(name: str) -> type[_OptimizerArgs] | None:
    """The settings model of one optimizer, derived from its constructor.

    ``None`` if its required arguments cannot be declared as data.
    """
    cls = OPTIMIZERS[name]
    init = inspect.unwrap(cls.__init__)
    signature = inspect.signature(init)
    hints = typing.get_type_hints(init)
    fields: dict[str, Any] = {"name": (Literal[name], ...)}
    for param_name, param in list(signature.parameters.items())[2:]:  # self, params
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        field_type = _settings_type(hints.get(param_name))
        required = param.default is param.empty
        if field_type is None:
            if required:
                return None
            continue  # left to the constructor's default
        default = ... if required else param.default
        # Named, not described: torch's docstrings change between versions, and the committed
        # schema (schemas/trainer_settings.schema.json) must not.
        description = f"``{param_name}`` of ``torch.optim.{name}`` (see its documentation)."
        fields[param_name] = (field_type, Field(default, description=description))
    base = _DecayOptimizerArgs if "weight_decay" in fields else _OptimizerArgs
    doc = f"Settings of ``torch.optim.{name}``: its constructor's keyword arguments."
    return create_model(f"{name}Settings", __base__=base, __doc__=doc, **fields)


_ARGS_MODELS = tuple(model for model in map(_optimizer_args_model, OPTIMIZERS) if model is not None)
if TYPE_CHECKING:
    # The union of models made at run time cannot be spelled statically: their common base stands in.
    _OptimizerArgsUnion = _OptimizerArgs
else:
    _OptimizerArgsUnion = Annotated[Union[_ARGS_MODELS], Field(discriminator="name")]  # noqa: UP007


#: What an optimizer may be named in ``optimizers`` (it becomes ``forward``'s argument and a metric key).
OPTIMIZER_NAME = r"^[A-Za-z_][A-Za-z0-9_.-]*$"


def optimizer_names_problem(names: Collection[object]) -> str | None:
    """Why ``names`` cannot name a run's optimizers, else ``None``: the one check of declared and built ones.

    At least one, each as ``OPTIMIZER_NAME`` says: the records key by it (``loss/<name>``, ``lr/<name>``, and
    ``lr/<name>/<group>`` for several param groups), so a ``/`` in it could make one optimizer's key another's.
    """
    if not names:
        return "no optimizer: give at least one"
    for name in names:
        if not isinstance(name, str) or re.fullmatch(OPTIMIZER_NAME, name) is None:
            return (
                f"{name!r} cannot name an optimizer: a name begins with a letter or '_' and holds letters, digits, "
                "'_', '.' and '-' (a '/' would mix it up with another optimizer's param groups in lr/<name>/<group>)"
            )
    return None


class OptimizerSettings(RootModel[_OptimizerArgsUnion]):
    """A ``torch.optim`` optimizer declared as data: ``{"name": ..., <its arguments>}``.

    ``name`` is the class name in ``torch.optim`` (``"AdamW"``, ``"SGD"``...); the other keys
    are the constructor's keyword arguments, validated against its signature (strict types;
    tensors are not declarable, so ``lr`` is a number) and then by the constructor itself, so
    an invalid value fails here, naming the argument. An optimizer that takes ``weight_decay``
    also accepts ``no_weight_decay``, a list of ``"bias"``, ``"norm"`` and ``"embedding"``:
    those parameters go to a second param group with ``weight_decay`` 0.

    Build it from keywords (``OptimizerSettings(name="AdamW", lr=1e-3)``) or a mapping
    (``OptimizerSettings.model_validate({...})``); ``build_optimizer`` makes the optimizer.
    """

    model_config = ConfigDict(frozen=True)

    @property
    def name(self) -> str:
        """The optimizer's class name in ``torch.optim``."""
        return self.root.name

    @property
    def optimizer_class(self) -> type[torch.optim.Optimizer]:
        """The optimizer's class."""
        return OPTIMIZERS[self.root.name]

    @property
    def kwargs(self) -> dict[str, Any]:
        """The constructor's keyword arguments (every declarable one, defaults included)."""
        return self.root.kwargs()

    @property
    def module(self) -> str | None:
        """The submodule whose parameters it optimizes, or ``None`` for the whole model."""
        return self.root.module

    @property
    def no_weight_decay(self) -> tuple[str, ...]:
        """The kinds of parameters that get no weight decay (empty: one param group)."""
        return getattr(self.root, "no_weight_decay", ())


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, _NORM_TYPES) or type(module).__name__.endswith("Norm")


def _no_decay_ids(model: nn.Module, rules: tuple[str, ...]) -> set[int]:
    """Ids of the parameters the rules exempt from weight decay.

    Module by module, so a parameter shared by two modules (tied weights) is exempt when
    either owner matches.
    """
    exempt: set[int] = set()
    for module in model.modules():
        whole = ("norm" in rules and _is_norm(module)) or (
            "embedding" in rules and isinstance(module, _EMBEDDING_TYPES)
        )
        for attr, param in module.named_parameters(recurse=False):
            if whole or ("bias" in rules and (attr == "bias" or attr.endswith("_bias"))):
                exempt.add(id(param))
    return exempt


def module_problem(settings: OptimizerSettings, model: nn.Module) -> str | None:
    """Why ``model`` has no submodule ``settings.module`` (the value, then what the model has), else ``None``."""
    if settings.module is None:
        return None
    try:
        model.get_submodule(settings.module)
    except AttributeError:
        children = ", ".join(name for name, _ in model.named_children()) or "none"
        return f"{settings.module!r}: {type(model).__name__} has no such submodule (its children: {children})"
    return None


def build_optimizer(settings: OptimizerSettings, model: nn.Module) -> torch.optim.Optimizer:
    """Build the optimizer that ``settings`` declare over ``model``'s trainable parameters.

    Param groups carry a ``"name"`` (what ``StatsHook`` keys
    learning rates by): one group ``"default"`` without ``no_weight_decay``; with it, ``"decay"``
    (the declared ``weight_decay``) and ``"no_decay"`` (``weight_decay`` 0), an empty one left
    out. Every trainable parameter is in exactly one group, shared parameters once.

    Args:
        settings: The optimizer's settings.
        model: The model whose parameters with ``requires_grad`` are optimized (frozen ones
            are left out).

    Returns:
        The optimizer.

    Raises:
        ValueError: The model has no trainable parameter, or the optimizer rejects its
            parameters (``Muon`` takes only 2-D ones).
    """
    problem = module_problem(settings, model)
    if problem is not None:
        raise ValueError(f"optimizer module={problem}")
    if settings.module is not None:
        model = model.get_submodule(settings.module)
    params = [param for param in model.parameters() if param.requires_grad]
    if not params:
        raise ValueError(f"{type(model).__name__} has no trainable parameter to optimize")
    rules = settings.no_weight_decay
    if rules:
        exempt = _no_decay_ids(model, rules)
        groups: list[dict[str, Any]] = [
            {"name": "decay", "params": [p for p in params if id(p) not in exempt]},
            {"name": "no_decay", "params": [p for p in params if id(p) in exempt], "weight_decay": 0.0},
        ]
        groups = [group for group in groups if group["params"]]
    else:
        groups = [{"name": "default", "params": params}]
    return settings.optimizer_class(groups, **settings.kwargs)
