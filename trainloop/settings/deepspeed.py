"""DeepSpeed's config as a run declares it: read (a mapping or a JSON file), checked against the settings, filled.

trainloop's settings own what both could say: the accumulation, the clipping, the precision and the micro batch
(the data loader's batch size). The config may repeat one of them only with the same value; a config that says
otherwise, or says it where trainloop's setting is unset, is refused in one line naming both (an unset
``grad_clip`` reaches DeepSpeed as ``gradient_clipping: 0``, or DeepSpeed would clip at 1.0 silently).

The config is also read as DeepSpeed reads it (``deepspeed_problems``): a key DeepSpeed never looks up would be
ignored silently, and a section its pydantic models refuse would fail only at ``deepspeed.initialize``; both are
told at validation, one line each. Only that check imports DeepSpeed, and only for a run that declares it.
"""

from __future__ import annotations

import copy
import difflib
import json
import logging
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

__all__ = [
    "AUTO_FILLED", "ZERO_STAGES", "ConfigProblem", "config_problems", "deepspeed_problems", "filled_config",
    "micro_batch_problem", "offload_device", "read_config", "zero_stage",
]

#: The ZeRO stages DeepSpeed has.
ZERO_STAGES = (0, 1, 2, 3)

#: Where ``"auto"`` (HF's Trainer's "from the trainer's settings") is taken: the values trainloop fills in itself.
AUTO_FILLED = (
    ("gradient_accumulation_steps",), ("gradient_clipping",), ("train_micro_batch_size_per_gpu",),
    ("train_batch_size",), ("bf16", "enabled"), ("fp16", "enabled"),
)

_PRECISIONS = ("bf16", "fp16")


class ConfigProblem(NamedTuple):
    """One problem of the config: where in it (``("zero_optimization", "stage")``), what, and the settings it names.

    Attributes:
        path: The keys from the config's top to the value (empty: the config as a whole).
        message: The line, naming the value as ``deepspeed.<path>``.
        fields: trainloop's settings the line names besides (``("grad_clip",)``): a user may have set them elsewhere.
    """

    path: tuple[str, ...]
    message: str
    fields: tuple[str, ...] = ()


def read_config(value: Mapping[str, Any] | str | Path) -> dict[str, Any]:
    """The config itself: ``value`` as a dict, or the JSON file it names read.

    Raises:
        ValueError: The file cannot be read, is not JSON, or holds something else than an object.
    """
    if isinstance(value, Mapping):
        return dict(value)
    path = Path(value)
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise ValueError(f"cannot read the DeepSpeed config {path}: {error.strerror or error}") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"the DeepSpeed config {path} is not JSON: {error}") from None
    if not isinstance(config, dict):
        raise ValueError(f"the DeepSpeed config {path} holds {type(config).__name__}, not an object")
    return config


def zero_stage(config: Mapping[str, Any]) -> int:
    """The config's ZeRO stage (0 when it declares none)."""
    stage = _section(config, "zero_optimization").get("stage", 0)
    return int(stage)


def offload_device(config: Mapping[str, Any]) -> str | None:
    """Where ``offload_optimizer`` keeps the optimizer states (``"cpu"``, ``"nvme"``); ``None``: on the device."""
    offload = _section(_section(config, "zero_optimization"), "offload_optimizer")
    device = offload.get("device")
    return device if device in ("cpu", "nvme") else None


def config_problems(
    config: Mapping[str, Any], *, accumulation: int, grad_clip: float | None, mixed_precision: str | None
) -> list[ConfigProblem]:
    """What in ``config`` contradicts trainloop's settings or cannot run, one problem each naming both sides.

    ``"auto"``, as HF's Trainer reads it, means "filled from the trainer's settings": trainloop takes it so where it
    fills the value itself (``AUTO_FILLED``), and refuses it elsewhere (it computes no bucket sizes).
    """
    problems = [
        ConfigProblem(path, f"deepspeed.{'.'.join(path)}: \"auto\" is filled in by HF's Trainer; trainloop fills "
                      "only gradient_accumulation_steps, gradient_clipping, the micro and global batch sizes and "
                      "bf16/fp16 enabled: give a value, or leave the key out for DeepSpeed's default")
        for path in _auto_paths(config) if path not in AUTO_FILLED
    ]
    stage = _section(config, "zero_optimization").get("stage", 0)
    if type(stage) is not int or stage not in ZERO_STAGES:
        problems.append(ConfigProblem(
            ("zero_optimization", "stage"),
            f"deepspeed.zero_optimization.stage: {stage!r} is not a ZeRO stage (0, 1, 2 or 3)",
        ))
    given = config.get("gradient_accumulation_steps")
    if given not in (None, "auto") and given != accumulation:
        problems.append(ConfigProblem(
            ("gradient_accumulation_steps",),
            f"deepspeed.gradient_accumulation_steps is {given!r} but gradient_accumulation_steps is {accumulation}: "
            "declare it once, in gradient_accumulation_steps",
            ("gradient_accumulation_steps",),
        ))
    clipping = config.get("gradient_clipping")
    if clipping not in (None, "auto") and clipping != (grad_clip or 0):
        ours = "unset (no clipping)" if grad_clip is None else repr(grad_clip)
        problems.append(ConfigProblem(
            ("gradient_clipping",),
            f"deepspeed.gradient_clipping is {clipping!r} but grad_clip is {ours}: declare it once, in grad_clip",
            ("grad_clip",),
        ))
    for precision in _PRECISIONS:
        enabled = _section(config, precision).get("enabled")
        if enabled is None or enabled == "auto":
            continue
        if bool(enabled) != (mixed_precision == precision):
            ours = "unset" if mixed_precision is None else repr(mixed_precision)
            problems.append(ConfigProblem(
                (precision, "enabled"),
                f"deepspeed.{precision}.enabled is {enabled!r} but mixed_precision is {ours}: "
                "declare the precision once, in mixed_precision",
                ("mixed_precision",),
            ))
    return problems


def deepspeed_problems(
    config: Mapping[str, Any], *, accumulation: int, mixed_precision: str | None
) -> list[ConfigProblem]:
    """What DeepSpeed's own reading of ``config`` refuses or would ignore, one problem each; none without DeepSpeed.

    The config is read by ``DeepSpeedConfig``, what ``deepspeed.initialize`` reads it with, through mappings that
    note every key DeepSpeed looks up. In a mapping DeepSpeed read key by key, a key it never looked up is one it
    ignores (``"zero_optimisation"`` would train without ZeRO): named, with the closest key it did look up there.
    A section DeepSpeed validates with its pydantic models (``zero_optimization``, ``fp16``, ...) is refused by
    them, one line per error; that section is then left out and the rest read again, so that every section is
    told at once. Where DeepSpeed is not installed nothing is checked (the run is refused for that, see
    ``trainloop.core.deepspeed``).

    Args:
        config: The config as declared.
        accumulation: ``gradient_accumulation_steps``, filled in as a run fills it (DeepSpeed checks the batch
            sizes against it); the micro batch, which only the data loader knows, is taken as 1 here.
        mixed_precision: ``mixed_precision``, filled in as a run fills it (``config_problems`` compares).
    """
    try:
        import deepspeed  # noqa: F401  (not importable: its modules imported before do not count)
        from deepspeed.runtime.config import DeepSpeedConfig
        from deepspeed.runtime.config_utils import DeepSpeedConfigModel
        from pydantic import ValidationError
    except ImportError:
        return []
    checked = filled_config(
        config, accumulation=accumulation, grad_clip=None, mixed_precision=mixed_precision, batch_size=None
    )
    given = config.get("train_micro_batch_size_per_gpu")
    checked["train_micro_batch_size_per_gpu"] = given if type(given) is int and given > 0 else 1
    checked.pop("train_batch_size", None)  # the data loader and the ranks decide it: checked when the run starts
    problems: list[ConfigProblem] = []
    refused: set[str] = set()  # sections pydantic refused: left out, their keys judged by it
    logger = logging.getLogger("DeepSpeed")
    level = logger.level
    logger.setLevel(logging.ERROR)  # its config logs what it read: not news at validation
    try:
        while True:
            reads = _Reads()
            try:
                DeepSpeedConfig(reads.wrap({k: v for k, v in checked.items() if k not in refused}))
            except ValidationError as error:
                section, lines = _pydantic_problems(error, checked, reads, DeepSpeedConfigModel)
                problems += lines
                if section is None or section in refused:
                    break
                refused.add(section)
                continue
            except (AssertionError, ValueError, TypeError, KeyError) as error:  # its own checks, in its words
                problems.append(ConfigProblem((), f"deepspeed: DeepSpeed refuses the config: {error}"))
                break
            problems += _unread(config, reads, (), refused)
            break
    finally:
        logger.setLevel(level)
    return problems


class _Reads:
    """The keys DeepSpeed looks up in the config, noted by the mappings it is handed (``wrap``)."""

    def __init__(self) -> None:
        self.paths: set[tuple[str, ...]] = set()  # values looked up by key
        self.tested: set[tuple[str, ...]] = set()  # keys asked about (``key in section``)
        self.whole: list[tuple[str, ...]] = []  # mappings read whole (``**section`` into a model), in order

    def wrap(self, config: Mapping[str, Any], path: tuple[str, ...] = ()) -> dict[str, Any]:
        values = {key: self.wrap(value, (*path, key)) if isinstance(value, Mapping) else value
                  for key, value in config.items()}
        return _NotingDict(values, self, path)


class _NotingDict(dict[str, Any]):
    """A dict that notes each key looked up in it (and a read of it whole) in ``reads``."""

    def __init__(self, values: dict[str, Any], reads: _Reads, path: tuple[str, ...]) -> None:
        super().__init__(values)
        self._reads, self._path = reads, path

    def __getitem__(self, key: str) -> Any:
        self._reads.paths.add((*self._path, key))
        return super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:
        self._reads.paths.add((*self._path, key))
        return super().get(key, default)

    def __contains__(self, key: object) -> bool:  # known, but not a reading of this mapping's keys
        self._reads.tested.add((*self._path, str(key)))
        return super().__contains__(key)

    def keys(self) -> Any:  # ``key in config.keys()`` is a lookup too
        return _NotingKeys(self)

    def __iter__(self) -> Iterator[str]:  # ``**section``, ``dict(section)``: read whole
        self._reads.whole.append(self._path)
        return super().__iter__()

    def __copy__(self) -> _NotingDict:  # a copy notes into the same reads (not a reading itself)
        return _NotingDict(dict(dict.items(self)), self._reads, self._path)

    def __deepcopy__(self, memo: dict[int, Any]) -> _NotingDict:
        return _NotingDict(copy.deepcopy(dict(dict.items(self)), memo), self._reads, self._path)


class _NotingKeys:
    """``config.keys()`` of a ``_NotingDict``: membership noted as a lookup."""

    def __init__(self, mapping: _NotingDict) -> None:
        self._mapping = mapping

    def __contains__(self, key: object) -> bool:
        return key in self._mapping

    def __iter__(self) -> Iterator[str]:
        return iter(self._mapping)

    def __len__(self) -> int:
        return len(self._mapping)


def _unread(
    config: Mapping[str, Any], reads: _Reads, path: tuple[str, ...], refused: set[str]
) -> list[ConfigProblem]:
    """The keys under ``path`` that DeepSpeed never looked up, in mappings it read key by key.

    A mapping DeepSpeed only asked about (``"max_grad_norm" in params``) is handed on whole (an optimizer's
    ``params`` become its arguments): not judged here.
    """
    known = reads.paths | reads.tested
    judged = path not in reads.whole and any(read[:-1] == path for read in reads.paths)
    looked_up = sorted({read[-1] for read in known if read[:-1] == path})
    problems = []
    for key, value in config.items():
        here = (*path, key)
        if not path and key in refused:
            continue
        if judged and here not in known:
            problems.append(ConfigProblem(here, f"deepspeed.{'.'.join(here)}: {_unknown(key, looked_up)}"))
        elif isinstance(value, Mapping) and path + (key,) not in reads.whole:
            problems += _unread(value, reads, here, refused)
    return problems


def _unknown(key: str, known: list[str]) -> str:
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"DeepSpeed reads no key {key!r} here, so it would be ignored{hint}"


def _pydantic_problems(
    error: Any, config: Mapping[str, Any], reads: _Reads, base: type[Any]
) -> tuple[str | None, list[ConfigProblem]]:
    """The lines of a DeepSpeed config model's ``error``, each at its path in ``config``; and the section it read."""
    model = next((cls for cls in _subclasses(base) if cls.__name__ == error.title), None)
    problems, section = [], None
    for item in error.errors(include_url=False):
        loc = tuple(str(part) for part in item["loc"])
        # The model read a section whole (its path the last read so), or the config's top (the monitors).
        candidates = [(*whole, *loc) for whole in reversed(reads.whole)] + [loc]
        path = next((c for c in candidates if _has(config, c)), candidates[0])
        section = path[0] if path else None
        where = f"deepspeed.{'.'.join(path)}"
        if item["type"] == "extra_forbidden":
            fields = _fields_at(model, loc[:-1]) if model is not None else []
            problems.append(ConfigProblem(path, f"{where}: {_unknown(loc[-1], fields)}"))
        else:
            message = item["msg"].removeprefix("Value error, ").removeprefix("Assertion failed, ")
            problems.append(ConfigProblem(path, f"{where}: {message} (got {item.get('input')!r})"))
    return section, problems


def _subclasses(cls: type[Any]) -> Iterator[type[Any]]:
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def _fields_at(model: type[Any], path: tuple[str, ...]) -> list[str]:
    """The keys the pydantic ``model`` takes at ``path`` (its names and their aliases)."""
    import typing

    for key in path:
        field = model.model_fields.get(key)
        if field is None:
            return []
        nested = [arg for arg in (field.annotation, *typing.get_args(field.annotation))
                  if isinstance(arg, type) and hasattr(arg, "model_fields")]
        if not nested:
            return []
        model = nested[0]
    return sorted({*model.model_fields, *(f.alias for f in model.model_fields.values() if f.alias)})


def _has(config: Any, path: tuple[str, ...]) -> bool:
    for key in path:
        if not isinstance(config, Mapping) or key not in config:
            return False
        config = config[key]
    return True


def micro_batch_problem(config: Mapping[str, Any], batch_size: int | None, accumulation: int, ranks: int) -> str | None:
    """What the config's batch sizes say against the data loader's ``batch_size`` (the micro batch), if anything."""
    given = config.get("train_micro_batch_size_per_gpu")
    if given is not None and given != "auto" and batch_size is not None and given != batch_size:
        return (
            f"deepspeed.train_micro_batch_size_per_gpu is {given!r} but the data loader's batch size is "
            f"{batch_size}: leave it out (trainloop fills it from the data loader)"
        )
    total = config.get("train_batch_size")
    if total is not None and total != "auto" and batch_size is not None and total != batch_size * accumulation * ranks:
        return (
            f"deepspeed.train_batch_size is {total!r} but the data loader's batch size {batch_size} x "
            f"gradient_accumulation_steps {accumulation} x {ranks} rank(s) is {batch_size * accumulation * ranks}: "
            "leave it out (DeepSpeed derives it)"
        )
    return None


def filled_config(
    config: Mapping[str, Any],
    *,
    accumulation: int,
    grad_clip: float | None,
    mixed_precision: str | None,
    batch_size: int | None,
) -> dict[str, Any]:
    """``config`` with what trainloop's settings own filled in (checked with ``config_problems`` first)."""
    filled = dict(config)
    if filled.get("train_batch_size") == "auto":  # DeepSpeed derives it from the micro batch
        del filled["train_batch_size"]
    filled["gradient_accumulation_steps"] = accumulation
    filled["gradient_clipping"] = grad_clip or 0.0
    for precision in _PRECISIONS:
        filled[precision] = {**_section(config, precision), "enabled": mixed_precision == precision}
    if batch_size is not None:
        filled["train_micro_batch_size_per_gpu"] = batch_size
    return filled


def _auto_paths(config: Mapping[str, Any], path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Where ``config`` says ``"auto"``, as key paths."""
    found = []
    for key, value in config.items():
        if value == "auto":
            found.append((*path, str(key)))
        elif isinstance(value, Mapping):
            found += _auto_paths(value, (*path, str(key)))
    return found


def _section(config: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    section = config.get(name)
    return section if isinstance(section, Mapping) else {}
