"""Hooks declared in settings: ``{"type": "checkpointing", "interval": 1000}``.

A hook class registers under a type name with ``register_hook``. Its settings model is
derived from its ``__init__`` signature (annotations and defaults), so a hook's parameters are
declared once, in Python, and validated the same way from code and from a settings file.

Types are looked up when settings are validated (and when a JSON Schema is generated), not when
this module is imported: a hook registered at any time before validation is declarable. The
built-in types are registered by their library, ``trainloop.hooks`` (``BUILT_IN_HOOKS``), which the
first lookup imports: settings declare them even where only ``trainloop.settings`` was imported,
and the engine, which imports this machinery, never imports a hook.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import json
from collections.abc import Iterable, Sequence
from functools import cache
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, GetCoreSchemaHandler, GetJsonSchemaHandler, create_model
from pydantic_core import PydanticCustomError, core_schema

from trainloop.hook_machinery.base import BaseHook

if TYPE_CHECKING:
    from pydantic.json_schema import JsonSchemaValue

__all__ = [
    "HOOK_TYPES",
    "HookSettings",
    "HookSpec",
    "build_declared_hooks",
    "hook_class",
    "hook_settings_model",
    "hook_types",
    "register_hook",
    "unregister_hook",
    "with_default_hooks",
]

#: Registered hook classes by type name.
HOOK_TYPES: dict[str, type[BaseHook]] = {}

#: The library whose import registers the built-in hook types.
BUILT_IN_HOOKS = "trainloop.hooks"


def hook_types() -> dict[str, type[BaseHook]]:
    """The registered hook classes by type name, the built-in ones included (their library imported once)."""
    importlib.import_module(BUILT_IN_HOOKS)
    return HOOK_TYPES


def hook_class(type_name: str) -> type[BaseHook] | None:
    """The hook class registered under ``type_name``, or ``None``."""
    return hook_types().get(type_name)

H = TypeVar("H", bound=type[BaseHook])


class HookSettings(BaseModel):
    """Base of every hook's settings model; ``build`` makes the hook."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    type: str
    name: str | None = Field(None, min_length=1)
    """The hook's name (its checkpoint state's key); by default its class name in snake case.
    Needed when a run has two hooks of one class."""

    def build(self) -> BaseHook:
        """Construct the hook these settings describe.

        The hook remembers the declaration it was built from (``hook.declared_by``), so the
        trainer does not build one declaration twice.
        """
        cls = hook_types()[self.type]
        hook = cls(**{name: getattr(self, name) for name in type(self).model_fields if name not in ("type", "name")})
        if self.name is not None:
            hook.name = self.name
        try:
            hook.declared_by = self  # type: ignore[attr-defined]
        except AttributeError:  # a hook with __slots__: build_hooks() should not build it then
            pass
        return hook


def register_hook(type_name: str) -> Any:
    """Class decorator: make a hook declarable in settings as ``{"type": type_name, ...}``.

    Register before the settings that declare the hook are validated (importing the module
    that defines the hook is enough); the JSON Schema includes it from then on.

    Args:
        type_name: The ``"type"`` a settings file gives.

    Raises:
        ValueError: Another class is registered under ``type_name``.
    """

    def decorate(cls: H) -> H:
        if type_name in HOOK_TYPES and HOOK_TYPES[type_name] is not cls:
            raise ValueError(f"hook type {type_name!r} is already registered by {HOOK_TYPES[type_name].__name__}")
        HOOK_TYPES[type_name] = cls
        cls.hook_type = type_name  # type: ignore[attr-defined]
        return cls

    return decorate


def unregister_hook(type_name: str) -> None:
    """Forget the hook type ``type_name`` (settings declaring it no longer validate)."""
    HOOK_TYPES.pop(type_name, None)


@cache
def hook_settings_model(cls: type[BaseHook]) -> type[HookSettings]:
    """The settings model of a registered hook class, derived from its ``__init__``.

    A parameter without an annotation takes any value (as ``pydantic.validate_call`` reads it); ``*args`` and
    ``**kwargs`` are not declarable in settings.
    """
    type_name: str = cls.hook_type  # type: ignore[attr-defined]
    signature = inspect.signature(inspect.unwrap(cls.__init__))
    hints = inspect.get_annotations(inspect.unwrap(cls.__init__), eval_str=True)
    fields: dict[str, Any] = {"type": (Literal[type_name], ...)}
    for name, param in list(signature.parameters.items())[1:]:
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        default = ... if param.default is param.empty else param.default
        fields[name] = (hints.get(name, Any), default)
    return create_model(
        f"{cls.__name__}Settings", __base__=HookSettings, __doc__=inspect.getdoc(cls), **fields
    )


def _unknown_type(type_name: object) -> PydanticCustomError:
    known = sorted(hook_types())
    close = difflib.get_close_matches(str(type_name), known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return PydanticCustomError(
        "hook_type",
        "unknown hook type {type}{hint}; registered types: {known} (register a hook class with "
        "trainloop.register_hook before the settings are validated)",
        {"type": repr(type_name), "hint": hint, "known": ", ".join(known)},
    )


def _validate_spec(value: Any, info: core_schema.ValidationInfo) -> HookSettings:
    """One declared hook, validated by the settings model of the type it names, looked up now."""
    if isinstance(value, HookSettings):
        if hook_class(value.type) is None:
            raise _unknown_type(value.type)
        return value
    if isinstance(value, BaseHook):
        # Someone coming from Lightning passes objects: they belong in build_hooks().
        declared = next((name for name, cls in hook_types().items() if type(value) is cls), None)
        as_data = (
            f' (or declare it as data: a mapping with "type": "{declared}" and its parameters)' if declared else ""
        )
        raise PydanticCustomError(
            "hook_spec",
            "settings.hooks holds hooks as data, not {kind} objects: return hook objects from build_hooks(){as_data}",
            {"kind": type(value).__name__, "as_data": as_data},
        )
    if not isinstance(value, dict):
        raise PydanticCustomError(
            "hook_spec", 'a hook is declared as a mapping with "type" and its parameters, not {kind}',
            {"kind": type(value).__name__},
        )
    if "type" not in value:
        raise PydanticCustomError(
            "hook_type_missing",
            'the hook has no "type"; registered types: {known}',
            {"known": ", ".join(sorted(hook_types()))},
        )
    cls = hook_class(value["type"]) if isinstance(value["type"], str) else None
    if cls is None:
        raise _unknown_type(value["type"])
    # mypy reads a class held in a variable as not Hashable (it takes __hash__ for the unbound method).
    model = hook_settings_model(cls)  # type: ignore[arg-type]
    # A ValidationError raised here keeps its locations, under this item's (hooks.0.interval).
    if info.mode == "json":  # strictness as in JSON: "a/b" is a Path, [1, 2] a tuple
        return model.model_validate_json(json.dumps(value))
    return model.model_validate(value)


def _serialize_spec(value: HookSettings, info: core_schema.SerializationInfo) -> Any:
    return value.model_dump(mode=info.mode, round_trip=True)


if TYPE_CHECKING:
    # What a ``HookSpec`` field holds once validated: mypy sees the value, pydantic the class below.
    HookSpec = HookSettings
else:
    class HookSpec:
        """The type of one declared hook: the settings of the hook type its ``"type"`` names.

        Use it as a field type (``hooks: tuple[HookSpec, ...]``). The type is looked up in the
        registry at validation time; the JSON Schema lists the types registered when it is made.
        """

        @classmethod
        def __get_pydantic_core_schema__(cls, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
            """A validator that looks the hook's type up in the registry when it runs."""
            return core_schema.with_info_plain_validator_function(
                _validate_spec,
                serialization=core_schema.plain_serializer_function_ser_schema(_serialize_spec, info_arg=True),
            )

        @classmethod
        def __get_pydantic_json_schema__(
            cls, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler
        ) -> JsonSchemaValue:
            """The registered hooks' settings, told apart by ``type`` (as registered right now)."""
            models = [hook_settings_model(hook_cls) for hook_cls in hook_types().values()]
            if not models:
                return {"type": "object", "properties": {"type": {"type": "string"}}, "required": ["type"]}
            union = core_schema.tagged_union_schema(
                {model.model_fields["type"].annotation.__args__[0]: model.__pydantic_core_schema__ for model in models},  # type: ignore[union-attr]
                discriminator="type",
            )
            return handler(union)


def build_declared_hooks(declared: Sequence[HookSettings], built: Iterable[BaseHook]) -> list[BaseHook]:
    """The hooks of a run: ``built`` (what ``build_hooks()`` returned), then each declared hook.

    A declaration that ``built`` already holds a hook of (one ``build_hooks()`` built with
    ``spec.build()``) is not built a second time, so a declared hook runs exactly once.

    Args:
        declared: ``settings.hooks``.
        built: The hooks ``build_hooks()`` returned.

    Returns:
        The hooks, in the order they are called.
    """
    hooks = list(built)
    already = {id(getattr(hook, "declared_by", None)) for hook in hooks}
    return hooks + [spec.build() for spec in declared if id(spec) not in already]


def with_default_hooks(hooks: list[BaseHook], settings: Any) -> list[BaseHook]:
    """``hooks``, led by those the registered classes add by themselves (``BaseHook.default_hook``).

    Each class that defines ``default_hook`` is asked once, in registration order: a subclass that
    only inherits it adds nothing more.

    Args:
        hooks: The hooks the run built and declared.
        settings: The run's validated ``TrainerSettings``.
    """
    added = [
        hook
        for cls in hook_types().values()
        if "default_hook" in vars(cls) and (hook := cls.default_hook(settings, hooks)) is not None
    ]
    # First: hooks that write records (TensorBoard, wandb) must receive a default hook's last flush.
    return [*added, *hooks]
