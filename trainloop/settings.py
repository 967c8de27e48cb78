"""Validated, immutable settings that drive a trainer.

Keyword arguments, a :class:`TrainerSettings` object and a settings file all end up as one
frozen ``TrainerSettings`` (or a subclass a trainer declares for its own knobs). Numbers and
booleans are strict: ``"10"`` is not taken for ``10``, and unknown keys are errors.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any, Literal, Self

import torch
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

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

    max_steps: PositiveInt
    """Number of optimizer steps to run."""
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

    @classmethod
    def from_file(cls, path: str | Path) -> Self:
        """Read settings from a JSON, YAML or TOML file (chosen by its extension).

        A ``"$schema"`` key, as editors use for completion, is ignored.

        Raises:
            SettingsFileError: The file is missing, malformed, or does not validate; the message
                names the file and every offending field.
        """
        path = Path(path)
        data = _read_mapping(path)
        data.pop("$schema", None)
        try:
            return cls.model_validate(data)
        except ValidationError as error:
            raise SettingsFileError(f"{path}: {error}") from error


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
