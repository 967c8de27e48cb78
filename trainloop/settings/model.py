"""Validated, immutable settings that drive a trainer.

Keyword arguments, a ``TrainerSettings`` object and a settings file all end up as one
frozen ``TrainerSettings`` (or a subclass a trainer declares for its own knobs). Numbers and
booleans are strict: ``"10"`` is not taken for ``10``, and unknown keys are errors.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, Self

import torch
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from trainloop.hook_machinery.registry import HookSpec
from trainloop.settings.deepspeed import config_problems, deepspeed_problems, read_config
from trainloop.settings.errors import DEEPSPEED_ERROR, describe_validation_error, in_our_words
from trainloop.settings.init_from import InitFromSettings
from trainloop.settings.optimizer import OPTIMIZER_NAME, OptimizerSettings, optimizer_names_problem
from trainloop.settings.schedule import LrScheduleSettings
from trainloop.settings.sources import ENV_PREFIX, SettingsFileError, SettingsInput, read_settings_input
from trainloop.settings.types import NonNegativeInt, PositiveFloat, PositiveInt, StrictBool, WorkspacePath

__all__ = ["ENV_PREFIX", "TRAINER_PATTERN", "SettingsFileError", "TrainerSettings", "resolve_settings"]

#: ``package.module:Class`` (the class may be nested: ``module:Outer.Inner``).
TRAINER_PATTERN = r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$"


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
    """Number of passes over the data to run: each batch of each epoch is drawn once, an
    epoch's last step taking the batches that remain (its loss divided by their number), and
    the run ends with the last epoch's last step (needs a data loader with ``len()``). At least
    one of ``max_steps`` and ``max_epochs`` is required."""
    grad_clip: PositiveFloat | None = None
    """Max gradient norm (L2); gradients are clipped before the optimizer step."""
    max_non_finite_grad_retries: NonNegativeInt | None = None
    """How often a step whose gradients are non-finite is redone (on fresh batches, the step
    not counted) before giving up with ``RuntimeError``; ``None`` or ``0``: raise at once.
    With a fused optimizer, which skips such an update on the device (the step counts), it
    bounds the skipped updates in a row, the error coming at most one step late. Under fp16
    GradScaler's refused updates are bounded by ``min_loss_scale`` instead (and by this too,
    when it is declared)."""
    min_loss_scale: PositiveFloat = 1e-4
    """fp16: the lowest loss scale GradScaler may reach. Each update it refuses (inf/NaN
    gradients; its first ones, by design, while it finds its scale) halves the scale and
    redoes the step (a fused optimizer skips it instead, after its first applied update);
    once the scale would fall below this, the run stops with ``RuntimeError``: the gradients
    are non-finite at any scale (fairseq's default)."""
    detect_non_finite_grads: StrictBool = True
    """Never apply an update whose gradients hold inf/NaN. A fused optimizer (``fused=True``:
    Adam, AdamW, SGD, Adagrad) is handed the check's flag and skips such an update in its
    kernel, the loop learning of it a step later: no host sync. With any other optimizer the
    loop waits for the check before stepping (one host sync per update) and redoes the step.
    Off: the optimizer steps on whatever the gradients hold (under fp16 GradScaler's check
    still refuses them)."""
    mixed_precision: Literal["bf16", "fp16"] | None = None
    """Autocast dtype for ``forward`` on the trainer's device; fp16 also enables GradScaler."""
    gradient_accumulation_steps: PositiveInt = 1
    """Microsteps (forward + backward) per optimizer step; the loss is divided by this."""
    workspace: WorkspacePath | None = None
    """Local directory for run artefacts (checkpoints, logs; never a URL: it holds the run's lock); hooks resolve
    paths under it."""
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
    seed_per_rank: StrictBool = False
    """Once the model is built (its initialisation the same on every rank), reseed the
    generators with ``seed + rank``, so dropout and a loader sampling with torch's global
    generator differ per rank (see docs/distributed.md); needs ``seed``."""
    optimizer: OptimizerSettings | None = None
    """An optimizer declared by name (any ``torch.optim`` optimizer) with its arguments, e.g.
    ``{"name": "AdamW", "lr": 1e-3, "no_weight_decay": ["bias", "norm"]}``; the default
    ``build_optimizer()`` builds it."""
    optimizers: dict[Annotated[str, Field(pattern=OPTIMIZER_NAME)], OptimizerSettings] | None = None
    """Several optimizers declared by name, in the order a step updates them (a GAN's
    ``{"discriminator": {"name": "Adam", "lr": 2e-4, "module": "discriminator"}, "generator":
    {...}}``): one update per optimizer per step, each calling ``forward(batch, optimizer)`` with
    its name. Instead of ``optimizer``, not with it."""
    lr_schedule: LrScheduleSettings | None = None
    """A learning-rate schedule (``constant``, ``linear``, ``cosine``, with warmup); the default
    ``build_lr_scheduler()`` builds it (one per optimizer)."""
    init_from: InitFromSettings | None = None
    """Start from these weights (the model's only, loaded in ``restoring``) unless a checkpoint
    of this run is resumed: a path to a checkpoint or a ``.safetensors`` / ``.pt`` file, or
    ``{"path": ..., "weights": "ema", "strict": false, "strip_prefixes": [...], "ignore":
    [...]}`` (see docs/checkpointing.md)."""
    hooks: tuple[HookSpec, ...] = ()
    """Hooks declared as data, each ``{"type": ..., <its parameters>}`` (e.g. ``{"type":
    "checkpointing", "interval": 1000}``); a run uses the hooks ``build_hooks()`` returns, then
    these, in this order."""
    deepspeed: dict[str, Any] | Path | None = None
    """Train through DeepSpeed: its own config, as a mapping (``{"zero_optimization": {"stage": 3}}``) or the path
    of a JSON file (a relative one from the working directory, as every path here); unset: no DeepSpeed.
    ``build_model()`` returns the plain module and ``build_optimizer()`` one optimizer; the trainer hands both to
    ``deepspeed.initialize``. trainloop fills the config's ``gradient_accumulation_steps``, ``gradient_clipping``
    (``grad_clip``; unset: 0), ``bf16``/``fp16`` (``mixed_precision``) and ``train_micro_batch_size_per_gpu`` (the
    data loader's batch size): the config may repeat them only with the same values. The config is read at
    validation as DeepSpeed reads it: a key DeepSpeed would ignore, or a section it would refuse, is an error naming
    it (see docs/distributed.md). Needs ``trainloop[deepspeed]``."""
    trainer: Annotated[str, Field(pattern=TRAINER_PATTERN)] | None = None
    """The trainer class ``trainloop run`` and ``trainloop validate`` use when no ``--trainer``
    is given, as ``package.module:Class``; a trainer constructed in Python ignores it."""

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

    @model_validator(mode="wrap")
    @classmethod
    def _unknown_keys_in_our_words(cls, data: Any, handler: ModelWrapValidatorHandler[Self]) -> Self:
        # pydantic's "Extra inputs are not permitted" says neither what is permitted nor what was
        # meant: a keyword typo reads as the command line reads the same key in a file.
        try:
            return handler(data)
        except ValidationError as error:
            raise in_our_words(error, data, cls) from None

    @model_validator(mode="after")
    def _run_is_bounded(self) -> Self:
        if self.max_steps is None and self.max_epochs is None:
            raise ValueError("give max_steps, max_epochs or both: the run needs an end")
        return self

    @field_validator("lr_schedule")
    @classmethod
    def _schedule_fits_the_run(
        cls, value: LrScheduleSettings | None, info: ValidationInfo
    ) -> LrScheduleSettings | None:
        # What the schedule alone cannot tell: its warmup_ratio of max_steps, the declared optimizer's lr
        # (both validated before it, in field order; a field that failed is absent and not checked).
        if value is not None:
            optimizer = info.data.get("optimizer")
            lr = optimizer.kwargs.get("lr") if optimizer is not None else None
            peaks = [lr] if isinstance(lr, (int, float)) and not isinstance(lr, bool) else []
            problems = value.problems_in(info.data.get("max_steps"), peaks)
            if problems:
                raise ValueError("; ".join(problems))
        return value

    @field_validator("optimizers", mode="before")
    @classmethod
    def _optimizer_names(cls, value: Any) -> Any:
        # Before the keys' own pattern: the check build_optimizer()'s names pass too, in its words.
        if isinstance(value, Mapping):
            problem = optimizer_names_problem(list(value))
            if problem is not None:
                raise ValueError(f"{problem}, or declare optimizer" if not value else problem)
        return value

    @model_validator(mode="after")
    def _one_way_to_declare_optimizers(self) -> Self:
        if self.optimizer is not None and self.optimizers is not None:
            raise ValueError("declare optimizer (one) or optimizers (several by name), not both")
        return self

    @model_validator(mode="after")
    def _seed_per_rank_needs_a_seed(self) -> Self:
        if self.seed_per_rank and self.seed is None:
            raise ValueError("seed_per_rank offsets the seed by rank: set seed too")
        return self

    @model_validator(mode="after")
    def _deepspeed_agrees(self) -> Self:
        if self.deepspeed is None:
            return self
        if self.optimizers is not None:
            raise ValueError("deepspeed drives one optimizer: declare optimizer, not optimizers")
        if self.init_from is not None:  # the engine's own copies of the weights would not see them
            raise ValueError(
                "init_from is not applied under deepspeed: load the weights in build_model() instead "
                "(trainloop.checkpoint.read_weights reads a checkpoint or an exported file)"
            )
        config = read_config(self.deepspeed)
        accumulation = self.gradient_accumulation_steps
        problems = config_problems(
            config, accumulation=accumulation, grad_clip=self.grad_clip, mixed_precision=self.mixed_precision
        )
        told = {problem.path for problem in problems}  # one mistake, one line: DeepSpeed's words only for the rest
        found = deepspeed_problems(config, accumulation=accumulation, mixed_precision=self.mixed_precision)
        problems += [problem for problem in found if problem.path not in told]
        if not problems:
            return self
        # Each at its place in the config, so that its line names where the value came from (file, --set, ...).
        in_file = f" (in {self.deepspeed})" if isinstance(self.deepspeed, Path) else ""
        errors = [
            InitErrorDetails(
                type=PydanticCustomError(
                    DEEPSPEED_ERROR, "{message}", {"message": problem.message + in_file, "fields": problem.fields}
                ),
                loc=("deepspeed", *problem.path),
                input=self.deepspeed,
            )
            for problem in problems
        ]
        raise ValidationError.from_exception_data(type(self).__name__, errors)

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

        Environment variables are named ``TRAINLOOP_<FIELD>`` (any case), with ``__`` between
        nested names: ``TRAINLOOP_OPTIMIZER__LR=0.5``, ``TRAINLOOP_LR_SCHEDULE__WARMUP_STEPS=10``,
        ``TRAINLOOP_HOOKS='[...]'``. Overrides are ``key.sub=value`` strings as the command line's
        ``--set`` gives them. A list item is addressed by index (``hooks.0.interval=5``) or, for
        a hook, by its type (``hooks.checkpointing.interval=5``,
        ``TRAINLOOP_HOOKS__CHECKPOINTING__INTERVAL=5``). Environment and override values are read
        as JSON when they are valid JSON (``10``, ``true``, ``null``, ``[1, 2]``) and as plain
        strings otherwise (``bf16``); quote a string that looks like JSON (``'"123"'``).

        Args:
            path: A JSON, YAML or TOML settings file, or ``None`` for none.
            env: The environment to read; ``os.environ`` when ``None``, ``{}`` for none.
            overrides: ``key.sub=value`` strings, applied in order.

        Raises:
            SettingsFileError: The file cannot be read, or the resolved settings do not
                validate; one line per problem, naming the file, variable or override the bad
                value came from and the field as written (``hooks[0].interval``).
        """
        return cls.validate_input(read_settings_input(path, os.environ if env is None else env, overrides))

    @classmethod
    def validate_input(cls, found: SettingsInput) -> Self:
        """Validate merged settings input (see ``load``).

        Raises:
            SettingsFileError: One line per bad field, naming where its value came from.
        """
        try:
            return cls.model_validate(found.data)
        except ValidationError as error:
            raise SettingsFileError(*describe_validation_error(error, found, cls)) from error

    @classmethod
    def json_schema(cls) -> dict[str, Any]:
        """The JSON Schema of these settings, hooks included; files may carry ``"$schema"``."""
        schema = cls.model_json_schema()
        schema["properties"] = {
            "$schema": {"type": "string", "description": "The schema of this file."},
            **schema["properties"],
        }
        return schema


def resolve_settings(
    settings_class: type[TrainerSettings], settings: TrainerSettings | None, overrides: dict[str, Any], owner: str
) -> TrainerSettings:
    """A trainer's settings: ``settings`` (or the defaults) with ``overrides`` validated into ``settings_class``.

    Args:
        settings_class: The trainer's settings class.
        settings: The settings object given, or ``None``.
        overrides: The settings given as keywords; they win over ``settings``.
        owner: The trainer class's name, for the message.

    Raises:
        TypeError: ``settings`` is not a ``TrainerSettings``.
        pydantic.ValidationError: A setting is invalid; the error names the field.
    """
    if settings is None:
        return settings_class(**overrides)
    if not isinstance(settings, TrainerSettings):
        raise TypeError(
            f"{owner}() takes a TrainerSettings as its only positional argument, "
            f"got {type(settings).__name__}; pass the other settings as keywords "
            "(e.g. max_steps=1000)"
        )
    if isinstance(settings, settings_class) and not overrides:
        return settings
    return settings_class.model_validate({**settings.model_dump(), **overrides})
