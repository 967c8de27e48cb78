"""Hooks declared in settings: ``{"type": "checkpointing", "interval": 1000}``.

A hook class registers under a type name with ``register_hook``. Its settings model is
derived from its ``__init__`` signature (annotations and defaults), so a hook's parameters are
declared once, in Python, and validated the same way from code and from a settings file.
"""

from __future__ import annotations

import inspect
from functools import cache
from typing import Annotated, Any, Literal, TypeVar, Union

from pydantic import BaseModel, ConfigDict, Field, create_model

from .base import BaseHook

__all__ = ["HOOK_TYPES", "HookSettings", "hook_settings_model", "hook_spec", "register_hook"]

#: Registered hook classes by type name.
HOOK_TYPES: dict[str, type[BaseHook]] = {}

H = TypeVar("H", bound=type[BaseHook])


class HookSettings(BaseModel):
    """Base of every hook's settings model; ``build`` makes the hook."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    type: str

    def build(self) -> BaseHook:
        """Construct the hook these settings describe."""
        cls = HOOK_TYPES[self.type]
        return cls(**{name: getattr(self, name) for name in type(self).model_fields if name != "type"})


def register_hook(type_name: str) -> Any:
    """Class decorator: make a hook declarable in settings as ``{"type": type_name, ...}``."""

    def decorate(cls: H) -> H:
        if type_name in HOOK_TYPES and HOOK_TYPES[type_name] is not cls:
            raise ValueError(f"hook type {type_name!r} is already registered by {HOOK_TYPES[type_name].__name__}")
        HOOK_TYPES[type_name] = cls
        cls.hook_type = type_name  # type: ignore[attr-defined]
        return cls

    return decorate


@cache
def hook_settings_model(cls: type[BaseHook]) -> type[HookSettings]:
    """The settings model of a registered hook class, derived from its ``__init__``.

    Parameters without an annotation, ``*args`` and ``**kwargs`` are not declarable in settings.
    """
    type_name: str = cls.hook_type  # type: ignore[attr-defined]
    signature = inspect.signature(inspect.unwrap(cls.__init__))
    hints = inspect.get_annotations(inspect.unwrap(cls.__init__), eval_str=True)
    fields: dict[str, Any] = {"type": (Literal[type_name], ...)}  # type: ignore[valid-type]
    for name, param in list(signature.parameters.items())[1:]:
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD) or name not in hints:
            continue
        default = ... if param.default is param.empty else param.default
        fields[name] = (hints[name], default)
    return create_model(  # type: ignore[call-overload]
        f"{cls.__name__}Settings", __base__=HookSettings, __doc__=inspect.getdoc(cls), **fields
    )


def hook_spec() -> Any:
    """The type of one declared hook: the registered hooks' settings, told apart by ``type``."""
    models = tuple(hook_settings_model(cls) for cls in HOOK_TYPES.values())
    return Annotated[Union[models], Field(discriminator="type")]  # type: ignore[valid-type]
