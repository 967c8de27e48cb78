"""Validated, immutable settings that drive a trainer.

Keyword arguments, a ``TrainerSettings`` object and a settings file all end up as one
frozen ``TrainerSettings`` (or a subclass a trainer declares for its own knobs). Numbers and
booleans are strict: ``"10"`` is not taken for ``10``, and unknown keys are errors.
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal, Self

import torch
from pydantic import (
    BaseModel,
    ConfigDict,
    ValidationError,
    field_validator,
    model_validator,
)

from .components import LrScheduleSettings, OptimizerSettings
from .hooks import HookSpec
from .types import NonNegativeInt, PositiveFloat, PositiveInt, StrictBool

__all__ = ["SettingsFileError", "TrainerSettings"]



class SettingsFileError(ValueError):
    """A settings file could not be read or did not validate; the message names the file."""


class TrainerSettings(BaseModel):
    """What a training run does, validated once and frozen.

    Subclass it to give a trainer its own knobs, and point the trainer's ``settings_class`` at
    the subclass::

        class MySettings(TrainerSettings):
            lr: float = 1e-3

        class MyTrainer(BaseTrainer):
            settings_class = MySettings
    """

    # Attribute docstrings become field descriptions (in the JSON Schema and the docs too).
    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True, use_attribute_docstrings=True)

    max_steps: PositiveInt | None = None
    """Number of optimizer steps to run (with ``max_epochs``: whichever limit comes first)."""
    max_epochs: PositiveInt | None = None
    """Number of passes over the data to run: the run ends with the step in which the last
    epoch's last batch is drawn (needs a data loader with ``len()``). At least one of
    ``max_steps`` and ``max_epochs`` is required."""
    grad_clip: PositiveFloat | None = None
    """Max gradient norm (L2); gradients are clipped before the optimizer step."""
    max_non_finite_grad_retries: NonNegativeInt | None = None
    """How often a step whose gradients are non-finite is redone before giving up with
    ``RuntimeError``; ``None`` or ``0``: raise at once."""
    detect_non_finite_grads: StrictBool = True
    """Check gradients for inf/NaN before each optimizer step (one host sync per step). Off: a
    sync-free hot loop, and the optimizer steps on whatever the gradients hold."""
    mixed_precision: Literal["bf16", "fp16"] | None = None
    """Autocast dtype for ``forward`` on the trainer's device; fp16 also enables GradScaler."""
    gradient_accumulation_steps: PositiveInt = 1
    """Microsteps (forward + backward) per optimizer step; the loss is divided by this."""
    workspace: Path | None = None
    """Directory for run artefacts (checkpoints, logs); hooks resolve paths under it."""
    device: str | None = None
    """Device to run on (``"cpu"``, ``"cuda:1"``...); ``None``: torch's default device."""
    no_sync_accumulate: StrictBool = True
    """Use the model's ``no_sync()`` (DDP/FSDP) on all but the last microstep of a step."""
    trace: StrictBool = False
    """Record every transition of the machine in ``trainer.trace``."""
    metrics_file: StrictBool = True
    """With a ``workspace``, append every ``trainer.log`` call to ``<workspace>/metrics.jsonl``."""
    seed: NonNegativeInt | None = None
    """Seed Python's, NumPy's and torch's generators with this when ``train()`` starts, on
    every rank, before anything is built."""
    optimizer: OptimizerSettings | None = None
    """An optimizer declared by name (any ``torch.optim`` optimizer) with its arguments, e.g.
    ``{"name": "AdamW", "lr": 1e-3, "no_weight_decay": ["bias", "norm"]}``; the default
    ``build_optimizer()`` builds it."""
    lr_schedule: LrScheduleSettings | None = None
    """A learning-rate schedule (``constant``, ``linear``, ``cosine``, with warmup); the default
    ``build_lr_scheduler()`` builds it."""
    hooks: tuple[HookSpec, ...] = ()
    """Hooks declared as data, each ``{"type": ..., <its parameters>}`` (e.g. ``{"type":
    "checkpointing", "interval": 1000}``); ``build_hooks()`` builds them, in this order."""

    @field_validator("gradient_accumulation_steps", mode="before")
    @classmethod
    def _none_means_one(cls, value: Any) -> Any:
        # The familiar API accepted ``gradient_accumulation_steps=None`` for "no accumulation".
        return 1 if value is None else value

    @field_validator("device", mode="before")
    @classmethod
    def _normalise_device(cls, value: Any) -> Any:
        if value is None:
            return None
        if isinstance(value, (torch.device, int)) and not isinstance(value, bool):
            value = str(torch.device(value))
        if isinstance(value, str):
            try:
                torch.device(value)
            except RuntimeError as error:
                raise ValueError(f"not a torch device: {value!r}") from error
        return value

    @model_validator(mode="after")
    def _run_is_bounded(self) -> Self:
        if self.max_steps is None and self.max_epochs is None:
            raise ValueError("give max_steps, max_epochs or both: the run needs an end")
        return self

    @model_validator(mode="after")
    def _warmup_fits(self) -> Self:
        # With max_epochs alone the step count is known once the data loader is built, and the
        # schedule is checked then.
        if self.max_steps is not None and self.lr_schedule is not None and self.lr_schedule.warmup_steps_for(self.max_steps) >= self.max_steps:
            raise ValueError(
                f"lr_schedule warmup ({self.lr_schedule.warmup_steps_for(self.max_steps)} steps) must be "
                f"shorter than max_steps ({self.max_steps})"
            )
        return self

    @classmethod
    def from_file(cls, path: str | Path) -> Self:
        """Read settings from a JSON, YAML or TOML file (chosen by its extension).

        A ``"$schema"`` key, as editors use for completion, is ignored.

        Raises:
            SettingsFileError: The file is missing, malformed, or does not validate; the message
                names the file and every offending field.
        """
        return cls.load(path, env={})

    @classmethod
    def load(
        cls,
        path: str | Path | None = None,
        *,
        env: Mapping[str, str] | None = None,
        overrides: Iterable[str] = (),
    ) -> Self:
        """Resolve settings from defaults < a file < environment variables < overrides.

        Environment variables are named ``TRAINLOOP_<FIELD>`` (case-insensitive), with ``__``
        between nested names (``TRAINLOOP_HOOKS='[...]'``). Overrides are ``key.sub=value``
        strings as the command line's ``--set`` gives them; list items are addressed by index
        (``hooks.0.interval=5``). Environment and override values are read as JSON when they
        are valid JSON (``10``, ``true``, ``null``, ``[1, 2]``) and as plain strings otherwise
        (``bf16``); quote a string that looks like JSON (``'"123"'``).

        Args:
            path: A JSON, YAML or TOML settings file, or ``None`` for none.
            env: The environment to read; ``os.environ`` when ``None``, ``{}`` for none.
            overrides: ``key.sub=value`` strings, applied in order.

        Raises:
            SettingsFileError: The file cannot be read, or the resolved settings do not
                validate; the message names the file (if any) and every offending field.
        """
        data: dict[str, Any] = {}
        if path is not None:
            data = _read_mapping(Path(path))
            data.pop("$schema", None)
        environment = os.environ if env is None else env
        _merge(data, _from_environment(cls, environment))
        for override in overrides:
            key, sep, value = override.partition("=")
            if not sep or not key.strip():
                raise SettingsFileError(f"override {override!r}: expected key=value (e.g. max_steps=100)")
            _set_path(data, key.strip().split("."), _parse_value(value), override)
        try:
            return cls.model_validate(data)
        except ValidationError as error:
            where = f"{path}" if path is not None else "settings"
            raise SettingsFileError(f"{where}: {error}") from error

    @classmethod
    def json_schema(cls) -> dict[str, Any]:
        """The JSON Schema of these settings, hooks included; files may carry ``"$schema"``."""
        schema = cls.model_json_schema()
        schema["properties"] = {"$schema": {"type": "string", "description": "The schema of this file."}, **schema["properties"]}
        return schema


ENV_PREFIX = "TRAINLOOP_"


def _from_environment(cls: type[BaseModel], env: Mapping[str, str]) -> dict[str, Any]:
    # pydantic-settings reads the prefix, case and nesting; scalars stay strings for _parse_value.
    from pydantic_settings import EnvSettingsSource

    source = EnvSettingsSource(cls, env_prefix=ENV_PREFIX, env_nested_delimiter="__", case_sensitive=False)  # type: ignore[arg-type]
    source.env_vars = {k.lower(): v for k, v in env.items()}
    return {k: _parse_value(v) if isinstance(v, str) else v for k, v in source().items()}


def _parse_value(text: str) -> Any:
    """JSON when the text is valid JSON (numbers, booleans, null, lists, objects), else the text."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def _merge(base: dict[str, Any], layer: Mapping[str, Any]) -> None:
    """Merge ``layer`` into ``base``: nested mappings key by key, anything else replaced."""
    for key, value in layer.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value


def _set_path(data: Any, keys: list[str], value: Any, override: str) -> None:
    for i, key in enumerate(keys):
        last = i == len(keys) - 1
        if isinstance(data, list):
            if not key.isdigit() or int(key) >= len(data):
                raise SettingsFileError(f"override {override!r}: {'.'.join(keys[:i + 1])} is not an item of a {len(data)}-item list")
            key = int(key)  # type: ignore[assignment]
        elif not isinstance(data, dict):
            raise SettingsFileError(f"override {override!r}: {'.'.join(keys[:i])} is not a mapping")
        if last:
            data[key] = value
        else:
            if isinstance(data, dict) and key not in data:
                data[key] = {}
            data = data[key]


def _read_mapping(path: Path) -> dict[str, Any]:
    suffix = path.suffix.lower()
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise SettingsFileError(f"{path}: cannot read settings file: {error.strerror}") from error
    try:
        if suffix == ".json":
            data = json.loads(text)
        elif suffix in (".yaml", ".yml"):
            import yaml  # only needed for YAML files

            data = yaml.safe_load(text)
        elif suffix == ".toml":
            data = tomllib.loads(text)
        else:
            raise SettingsFileError(
                f"{path}: unknown settings file type {suffix!r}; use .json, .yaml, .yml or .toml"
            )
    except SettingsFileError:
        raise
    except Exception as error:  # each parser raises its own error type
        raise SettingsFileError(f"{path}: malformed {suffix[1:].upper()}: {error}") from error
    if not isinstance(data, dict):
        raise SettingsFileError(f"{path}: expected a mapping of settings, got {type(data).__name__}")
    return data
