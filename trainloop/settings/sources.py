"""The layers settings are resolved from: a file < ``TRAINLOOP_*`` environment < ``--set``.

Each layer writes into one plain mapping, and every value remembers where it came from (the
file, the variable, the override), so that an invalid value is reported under the name the user
wrote. Validation itself is ``TrainerSettings``'s; this module only reads and merges.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["ENV_PREFIX", "SettingsFileError", "SettingsInput", "parse_value", "read_settings_input"]

#: The prefix of the environment variables that set settings.
ENV_PREFIX = "TRAINLOOP_"

#: One step of a path into the settings: a key, or an index into a list.
Key = str | int


class SettingsFileError(ValueError):
    """Settings could not be read or did not validate.

    The message names the file, variable or override, and every offending field, one line per problem.

    Attributes:
        problems: The lines of the message, one per problem.
    """

    def __init__(self, *problems: str) -> None:
        super().__init__("\n".join(problems))
        self.problems = list(problems)


@dataclass
class SettingsInput:
    """The merged, not yet validated, settings and where each value came from.

    Attributes:
        data: The merged mapping.
        sources: Path of a value (``("hooks", 0, "interval")``) -> where it was set
            (``"run.yaml"``, ``"TRAINLOOP_HOOKS__CHECKPOINTING__INTERVAL"``, ``"--set hooks.0.interval=5"``).
        default_source: What a problem with no more specific source is blamed on (the file, if any).
    """

    data: dict[str, Any] = field(default_factory=dict)
    sources: dict[tuple[Key, ...], str] = field(default_factory=dict)
    default_source: str = "settings"

    def source_of(self, path: tuple[Key, ...]) -> str:
        """Where the value at ``path`` came from.

        The layer that set it or the nearest mapping around it, and every layer that set something inside it
        (``"run.yaml, TRAINLOOP_X__Y"``).
        """
        found = self.default_source
        if not path:  # about the settings as a whole: the file, if any
            return found
        for end in range(len(path), -1, -1):
            if path[:end] in self.sources:
                found = self.sources[path[:end]]
                break
        inside = [
            source for known, source in self.sources.items() if len(known) > len(path) and known[: len(path)] == path
        ]
        return ", ".join(dict.fromkeys([found, *inside]))

    def set(self, keys: list[str], value: Any, source: str) -> None:
        """Set ``keys`` (a dotted path as given) to ``value``, creating mappings on the way.

        A list item is addressed by index (``hooks.0``) or, for hooks, by its ``type``
        (``hooks.checkpointing``) when exactly one item has that type.

        Raises:
            SettingsFileError: The path runs through something that is not a mapping, or names
                a list item that does not exist; the message names ``source``.
        """
        node: Any = self.data
        path: list[Key] = []
        for i, key in enumerate(keys):
            if isinstance(node, list):
                index = _list_index(node, key, source, ".".join(map(str, path)))
                path.append(index)
                step: Key = index
            elif isinstance(node, dict):
                path.append(key)
                step = key
            elif isinstance(node, str):  # a file named in place of the mapping (deepspeed: ds.json)
                raise SettingsFileError(
                    f"{source}: {_dotted(path)} is {node!r}, not a mapping, so it has no {key!r}: where {node!r} names "
                    f"a file, set {key!r} in it, or replace the whole value ({_dotted(path)}=...)"
                )
            else:
                raise SettingsFileError(f"{source}: {_dotted(path)} is not a mapping, so it has no {key!r}")
            if i == len(keys) - 1:
                node[step] = value
            else:
                if isinstance(node, dict) and step not in node:
                    if path == ["hooks"]:  # a hook addressed by type: there must be one
                        _list_index([], keys[i + 1], source, "hooks")
                    node[step] = {}
                    self.sources[tuple(path)] = source  # made for this value: blame it for it
                node = node[step]
        # A layer set this value whole: forget the sources of what it replaced.
        cut = tuple(path)
        for known in [p for p in self.sources if p[: len(cut)] == cut]:
            del self.sources[known]
        self.sources[cut] = source


def _dotted(path: list[Key]) -> str:
    return ".".join(map(str, path)) or "(settings)"


def _list_index(items: list[Any], key: str, source: str, where: str) -> int:
    """The index ``key`` names in ``items``: a number, or the ``type`` of exactly one item."""
    if key.isdigit():
        if int(key) < len(items):
            return int(key)
        raise SettingsFileError(f"{source}: {where}.{key} is not an item of a {len(items)}-item list")
    matches = [
        i for i, item in enumerate(items) if isinstance(item, dict) and str(item.get("type", "")).lower() == key.lower()
    ]
    if len(matches) == 1:
        return matches[0]
    types = [str(item.get("type")) for item in items if isinstance(item, dict)]
    if matches:
        raise SettingsFileError(
            f"{source}: {where} has {len(matches)} items of type {key!r} (items {', '.join(map(str, matches))}): "
            f"address one by index ({where}.{matches[0]})"
        )
    listed = f"its items' types are {', '.join(types)}" if types else "it is empty"
    raise SettingsFileError(f"{source}: {where} has no item of type {key!r} ({listed}); address items by type or index")


def parse_value(text: str) -> Any:
    """JSON when the text is valid JSON (numbers, booleans, null, lists, objects), else the text."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def read_settings_input(
    path: str | Path | None,
    env: Mapping[str, str],
    overrides: Iterable[str] = (),
) -> SettingsInput:
    """Read and merge the layers: ``path`` < ``env``'s ``TRAINLOOP_*`` variables < ``overrides``.

    Variables are ``TRAINLOOP_<FIELD>`` in any case, ``__`` between nested names
    (``TRAINLOOP_OPTIMIZER__LR``, ``TRAINLOOP_HOOKS__CHECKPOINTING__INTERVAL``); overrides are
    ``key.sub=value``. Values of both are read as JSON when they are valid JSON, else as text.

    Raises:
        SettingsFileError: The file cannot be read or parsed, or a variable or override cannot
            be applied; the message names it.
    """
    found = SettingsInput()
    if path is not None:
        found.default_source = str(path)
        found.data = _read_mapping(Path(path))
        found.data.pop("$schema", None)
        for key in found.data:
            found.sources[(key,)] = str(path)
    # Outer names before nested ones, so TRAINLOOP_HOOKS='[...]' is there for TRAINLOOP_HOOKS__0__...
    variables = sorted(
        ((name, value) for name, value in env.items() if name.upper().startswith(ENV_PREFIX)),
        key=lambda item: (item[0].count("__"), item[0].upper()),
    )
    for name, value in variables:
        keys = name[len(ENV_PREFIX):].lower().split("__")
        if not all(keys):
            raise SettingsFileError(f"{name}: expected {ENV_PREFIX}<FIELD>, with __ between nested names")
        found.set(keys, parse_value(value), name)
    for override in overrides:
        key, sep, value = override.partition("=")
        if not sep or not key.strip():
            raise SettingsFileError(f"override {override!r}: expected key=value (e.g. max_steps=100)")
        found.set(key.strip().split("."), parse_value(value), f"--set {override}")
    return found


def _read_mapping(path: Path) -> dict[str, Any]:
    """The mapping a JSON, YAML or TOML file holds, chosen by the file's extension."""
    suffix = path.suffix.lower()
    if suffix not in (".json", ".yaml", ".yml", ".toml"):
        raise SettingsFileError(f"{path}: unknown settings file type {suffix!r}; use .json, .yaml, .yml or .toml")
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as error:
        raise SettingsFileError(f"{path}: cannot read settings file: {error.strerror}") from error
    except UnicodeDecodeError as error:
        raise SettingsFileError(
            f"{path}: not a UTF-8 text file (byte {error.object[error.start]:#04x} at offset {error.start}); "
            "save it as UTF-8"
        ) from error
    try:
        if suffix == ".json":
            data = json.loads(text)
        elif suffix == ".toml":
            data = tomllib.loads(text)
        else:
            import yaml  # only needed for YAML files

            data = yaml.safe_load(text)
    except Exception as error:  # each parser raises its own error type; re-raised as ours below
        message = " ".join(str(error).split())  # YAML's messages span lines: one line per problem
        raise SettingsFileError(f"{path}: malformed {suffix[1:].upper()}: {message}") from error
    if not isinstance(data, dict):
        raise SettingsFileError(f"{path}: expected a mapping of settings, got {type(data).__name__}")
    return data
