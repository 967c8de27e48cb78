"""A pydantic ``ValidationError`` as one line per bad field, named as the user wrote it.

pydantic locates an error inside unions by tags of its own (``exit_code.literal['128+signal']``,
``load.lax-or-strict[...]``, ``optimizer.AdamW.lr``) and reports each union branch separately.
A user wrote ``hooks[0].exit_code``: the tags are dropped (a location part is kept only where the
input has it), the branches' messages are merged into one line, and the line says which file,
variable or override the value came from.
"""

from __future__ import annotations

import difflib
import re
import typing
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails, InitErrorDetails, PydanticCustomError

from trainloop.hook_machinery.registry import HookSpec, hook_class, hook_settings_model
from trainloop.settings.sources import Key, SettingsInput

__all__ = ["DEEPSPEED_ERROR", "describe_validation_error", "field_path", "in_our_words"]

#: The error type of a problem in ``settings.deepspeed``'s config: its message names the key, its ``fields`` context
#: the settings it names besides (``grad_clip``), whose sources the line names too.
DEEPSPEED_ERROR = "deepspeed_config"

_MAX_SHOWN = 60
# Our error type for a key no field has: pydantic's "extra_forbidden", in the CLI's words.
_UNKNOWN = "unknown_setting"
_UNKNOWN_TYPES = {"extra_forbidden", _UNKNOWN}
# The error types where the last location part is a field the input lacks (not a tag).
_ABSENT_FIELD = {"missing", "missing_keyword_argument"}
_NUMBER_ERRORS = {"int_type", "int_parsing", "float_type", "float_parsing", "int_from_float"}


def field_path(path: tuple[Key, ...]) -> str:
    """``("hooks", 0, "exit_code")`` as a user writes it: ``hooks[0].exit_code``."""
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "(settings)"


def _user_path(loc: tuple[Key, ...], data: Any, error_type: str) -> tuple[Key, ...]:
    """The part of ``loc`` the input has; pydantic's union tags are left out."""
    kept: list[Key] = []
    node = data
    for i, part in enumerate(loc):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, (list, tuple)) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        elif i == len(loc) - 1 and error_type in _ABSENT_FIELD and isinstance(node, dict):
            pass  # a required field the mapping lacks
        else:
            continue  # a tag: pydantic's name for a union branch, not a key of the input
        kept.append(part)
    return tuple(kept)


def _model_at(cls: type[BaseModel], data: Any, path: tuple[Key, ...]) -> type[BaseModel] | None:
    """The settings model that validates the mapping at ``path``, where one can be told."""
    model: type[BaseModel] | None = cls
    node = data
    annotation: Any = None
    for part in path:
        if isinstance(part, int):
            node = node[part] if isinstance(node, (list, tuple)) and part < len(node) else None
            annotation = _item_type(annotation)
        else:
            if model is None or part not in model.model_fields:
                return None
            annotation = model.model_fields[part].annotation
            node = node.get(part) if isinstance(node, dict) else None
        model = _model_of(annotation, node)
    return model


def _item_type(annotation: Any) -> Any:
    args = [arg for arg in typing.get_args(annotation) if arg is not Ellipsis]
    return args[0] if len(args) == 1 else None


def _model_of(annotation: Any, node: Any) -> type[BaseModel] | None:
    """The model class ``annotation`` validates ``node`` with (unwrapping ``X | None``)."""
    if annotation is HookSpec:
        type_name = node.get("type") if isinstance(node, dict) else None
        cls = hook_class(type_name) if isinstance(type_name, str) else None
        # mypy reads a class held in a variable as not Hashable (it takes __hash__ for the unbound method).
        return hook_settings_model(cls) if cls is not None else None  # type: ignore[arg-type]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    candidates = [_model_of(arg, node) for arg in typing.get_args(annotation) if arg is not type(None)]
    candidates = [c for c in candidates if c is not None]
    return candidates[0] if len(candidates) == 1 else None


def _message(item: ErrorDetails) -> str:
    context = item.get("ctx") or {}
    if item["type"] == "union_tag_not_found":
        return f"needs a {context.get('discriminator', 'tag')} key"
    if item["type"] == "union_tag_invalid":
        tag, expected = str(context.get("tag")), str(context.get("expected_tags", ""))
        tags = {t.strip(" '").lower(): t.strip(" '") for t in expected.split(",")}
        close = difflib.get_close_matches(tag.lower(), list(tags), n=1)
        hint = f" (did you mean {tags[close[0]]!r}?)" if close else ""
        return f"unknown {str(context.get('discriminator')).strip(chr(39))} {tag!r}{hint}; expected one of {expected}"
    message: str = item["msg"]
    for prefix in ("Value error, ", "Assertion failed, "):
        message = message.removeprefix(prefix)
    return message


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _MAX_SHOWN else text[: _MAX_SHOWN - 3] + "..."


def _number_hint(value: Any) -> str:
    """A hint when a number was given as text (YAML 1.1 reads ``3e-3`` as a string)."""
    if not isinstance(value, str):
        return ""
    try:
        float(value)
    except ValueError:
        return ""
    hint = f"; {value!r} is text, not a number"
    if re.fullmatch(r"[+-]?\d+[eE][+-]?\d+", value.strip()):
        mantissa, exponent = re.split("[eE]", value.strip())
        hint += f" (YAML reads an exponent without a dot as text: write {mantissa}.0e{exponent})"
    return hint


def describe_validation_error(error: ValidationError, found: SettingsInput, cls: type[BaseModel]) -> list[str]:
    """One line per bad field of ``error``: ``<source>: <field>: <what is wrong> (got <value>)``.

    Args:
        error: What validating ``found.data`` with ``cls`` raised.
        found: The input, and where each value came from.
        cls: The settings class.

    Returns:
        The lines, in the order pydantic reported the fields.
    """
    grouped: dict[tuple[Key, ...], list[ErrorDetails]] = {}
    for item in error.errors(include_url=False):
        grouped.setdefault(_user_path(tuple(item["loc"]), found.data, item["type"]), []).append(item)
    _drop_missing_fields_a_typo_meant(grouped, cls, found.data)
    lines = []
    for path, items in grouped.items():
        where = f"{found.source_of(path)}: {field_path(path)}"
        first = items[0]
        if first["type"] == DEEPSPEED_ERROR:
            lines += [_deepspeed_line(item, path, found) for item in items]
            continue
        if first["type"] in _UNKNOWN_TYPES:
            lines.append(f"{where}: {_unknown_field(cls, found.data, path)}")
            continue
        messages: list[str] = []
        # A union branch whose own check refused the value (an empty path) says more than the
        # other branches' "Input should be ...": keep only such messages when there are some.
        refused = [item for item in items if item["type"] == "value_error"]
        for item in refused or items:
            message = _message(item)
            if messages and message.startswith("Input should be ") and messages[0].startswith("Input should be "):
                message = message.removeprefix("Input should be ")
            if message not in messages:
                messages.append(message)
        line = f"{where}: {' or '.join(messages)}"
        if first["type"] not in _ABSENT_FIELD and path:  # the whole input is no help to show
            line += f" (got {_shown(first.get('input'))})"
            if any(item["type"] in _NUMBER_ERRORS for item in items):
                line += _number_hint(first.get("input"))
        lines.append(line)
    return lines


def _deepspeed_line(item: ErrorDetails, path: tuple[Key, ...], found: SettingsInput) -> str:
    """A line of the DeepSpeed config's problem: the sources of its key and of the settings it names, its message.

    The message names the key as written (``deepspeed.gradient_clipping``); a setting it names besides may come from
    elsewhere (``grad_clip`` from ``--set``, the config from the file).
    """
    fields = (item.get("ctx") or {}).get("fields", ())
    sources = [found.source_of(path), *(found.source_of((field,)) for field in fields if field in found.data)]
    return f"{', '.join(dict.fromkeys(sources))}: {_message(item)}"


def _drop_missing_fields_a_typo_meant(
    grouped: dict[tuple[Key, ...], list[ErrorDetails]], cls: type[BaseModel], data: Any
) -> None:
    """Leave out "field required" where an unknown key beside it is that field misspelt: one mistake, one line."""
    for path, items in list(grouped.items()):
        if not path or items[0]["type"] not in _UNKNOWN_TYPES:
            continue
        model = _model_at(cls, data, path[:-1])
        valid = [f for f in model.model_fields if f != "type"] if model is not None else []
        for meant in difflib.get_close_matches(str(path[-1]), valid, n=1, cutoff=0.6):
            missing = grouped.get((*path[:-1], meant))
            if missing and all(item["type"] in _ABSENT_FIELD for item in missing):
                del grouped[(*path[:-1], meant)]


def _unknown_field(cls: type[BaseModel], data: Any, path: tuple[Key, ...]) -> str:
    """``unknown setting 'lr'`` with a "did you mean" when a valid name is close."""
    name = str(path[-1]) if path else ""
    model = _model_at(cls, data, path[:-1])
    valid = [f for f in model.model_fields if f != "type"] if model is not None else []
    close = difflib.get_close_matches(name, valid, n=1, cutoff=0.6)
    text = f"unknown setting {name!r}"
    if close:
        return f"{text}; did you mean {close[0]!r}?"
    if valid:
        return f"{text}; valid here: {', '.join(valid)}"
    return text


def in_our_words(error: ValidationError, data: Any, cls: type[BaseModel]) -> ValidationError:
    """``error`` with pydantic's "Extra inputs are not permitted" said as the command line says it.

    ``MyTrainer(max_stpes=5)`` then reads ``unknown setting 'max_stpes'; did you mean
    'max_steps'?``, as ``trainloop validate`` does for the same key in a file: one voice. The
    exception stays a ``pydantic.ValidationError`` with the same locations; other errors are kept.

    Args:
        error: What validating ``data`` with ``cls`` raised.
        data: The input.
        cls: The settings class.
    """
    items = error.errors(include_url=False)
    if not any(item["type"] == "extra_forbidden" for item in items):
        return error
    details: list[InitErrorDetails] = []
    for item in items:
        if item["type"] == "extra_forbidden":
            text = _unknown_field(cls, data, _user_path(tuple(item["loc"]), data, item["type"]))
            item = {**item, "type": PydanticCustomError(_UNKNOWN, "{message}", {"message": text})}  # type: ignore[typeddict-item]
        details.append(item)  # type: ignore[arg-type]
    return ValidationError.from_exception_data(error.title, details)
