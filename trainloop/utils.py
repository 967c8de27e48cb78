"""Helpers for what a run handles and writes: nested records, models inside their wrappers, strict JSON.

``Records`` are the nested dicts of numbers ``forward`` returns and hooks aggregate and log;
``unwrap_model`` sees through ``torch.compile``, DDP, FSDP and ``AveragedModel``; the JSON helpers
write no ``NaN`` (other readers refuse it) and append JSON lines that never join a line a killed
writer cut short; ``warn_user`` says a warning once, pointing at the user's code, and
``user_traceback`` trims an error's traceback to the user's frames and trainloop's call.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import math
import os
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from numbers import Number
from pathlib import Path
from types import FrameType, TracebackType
from typing import IO, Any, TypeAlias, Union

import torch
import transitions
from torch import nn

from trainloop.distributed.ranks import in_process_group, rank

__all__ = ["flatten_nested_dict", "key_average", "map_nested_tensor"]  # what users import; the rest serves trainloop


Records: TypeAlias = dict[str, Union[int, float, torch.Tensor, "Records"]]
"""A nested dict of numbers (or scalar tensors), as ``forward`` returns and hooks log."""


def map_nested_tensor(fn: Callable[[torch.Tensor], Any], obj: Any) -> Any:
    """Apply ``fn`` to every tensor inside nested dicts, lists and tuples (named tuples too).

    Anything that is not a tensor or a container is returned as it is, so a batch can be moved
    to a device with ``map_nested_tensor(lambda t: t.to(device), batch)``.
    """
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, Mapping):
        return type(obj)((k, map_nested_tensor(fn, v)) for k, v in obj.items())  # type: ignore[call-arg]
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # named tuple
        return type(obj)(*(map_nested_tensor(fn, v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_nested_tensor(fn, v) for v in obj)
    return obj


def to_float(value: Any, key: str) -> float:
    """A record's value as a Python float (a host sync for a tensor); errors name the ``key``.

    Raises:
        TypeError: The value is not a number or a tensor.
        ValueError: The tensor has more than one element.
    """
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"record {key!r} is a tensor of shape {tuple(value.shape)}, not a scalar")
        return float(value.item())
    if isinstance(value, Number) and not isinstance(value, complex):
        return float(value)  # type: ignore[arg-type]
    raise TypeError(f"record {key!r} is a {type(value).__name__}, not a number")


def key_average(records: Iterable[Mapping[str, Any]], exclude_nan: bool = False) -> Records:
    """Average nested records key by key.

    A key missing from some records is averaged over the records that have it. With
    ``exclude_nan``, NaN values are left out of their key's average (a key that is NaN
    everywhere stays NaN).

    Raises:
        TypeError: A value is neither a number nor a scalar tensor (the message names the key).
    """
    sums: dict[str, Any] = {}
    for record in records:
        _accumulate(sums, record, exclude_nan, prefix="")
    return _divide(sums)


def _accumulate(sums: dict[str, Any], record: Mapping[str, Any], exclude_nan: bool, prefix: str) -> None:
    for key, value in record.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping):
            _accumulate(sums.setdefault(key, {}), value, exclude_nan, prefix=f"{path}/")
            continue
        number = to_float(value, path)
        total, count, nan_seen = sums.get(key, (0.0, 0, False))
        if exclude_nan and math.isnan(number):
            sums[key] = (total, count, True)
        else:
            sums[key] = (total + number, count + 1, nan_seen)


def _divide(sums: dict[str, Any]) -> Records:
    result: Records = {}
    for key, value in sums.items():
        if isinstance(value, dict):
            result[key] = _divide(value)
        else:
            total, count, _ = value
            result[key] = total / count if count else math.nan
    return result


def flatten_nested_dict(d: Mapping[str, Any], sep: str = "/", prefix: str = "") -> dict[str, Any]:
    """Flatten nested dicts into one level: ``{"a": {"b": 1}}`` becomes ``{"a/b": 1}``."""
    flat: dict[str, Any] = {}
    for key, value in d.items():
        name = f"{prefix}{sep}{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            flat.update(flatten_nested_dict(value, sep, name))
        else:
            flat[name] = value
    return flat


def hint_for_missing_key(key: str, seen: Iterable[str]) -> str:
    """A hint for a key that was never seen among ``seen``.

    ``"; did you mean 'val/loss'?"``, else the keys seen (at most 20), else ``""``.
    """
    seen = sorted(set(seen))
    close = difflib.get_close_matches(key, seen, n=3)
    if close:
        return f"; did you mean {' or '.join(repr(k) for k in close)}?"
    if seen:
        return f"; keys logged: {', '.join(seen[:20])}"
    return ""


def unwrap_model(module: nn.Module) -> nn.Module:
    """See through ``torch.compile``, DDP, DataParallel, ``AveragedModel`` and DeepSpeed's engine."""
    engine = sys.modules.get("deepspeed.runtime.engine")  # never imported: no engine exists
    while True:
        if isinstance(module, torch._dynamo.eval_frame.OptimizedModule):
            module = module._orig_mod  # torch.compile's wrapper has no public accessor for it
        elif isinstance(
            module,
            (
                nn.parallel.DistributedDataParallel,
                nn.DataParallel,
                torch.optim.swa_utils.AveragedModel,
            ),
        ):
            module = module.module
        elif engine is not None and isinstance(module, engine.DeepSpeedEngine):
            module = module.module
        else:
            return module


@contextlib.contextmanager
def module_modes_kept(model: nn.Module, train: bool) -> Iterator[None]:
    """Put ``model`` in train or eval mode for the block, then give every submodule its own mode back.

    Also when the block raises.
    """
    modules = list(model.modules())
    modes = [m.training for m in modules]
    model.train(train)
    try:
        yield
    finally:
        # ``model.train(mode)`` first, so modules that override ``train()`` (to keep a BatchNorm
        # frozen, say) run their own logic; then the recorded flags, because ``train(mode)`` alone
        # would flatten a model whose submodules were in mixed modes.
        model.train(modes[0])
        for module, mode in zip(modules, modes):
            module.training = mode


def is_distributed_model(model: nn.Module) -> bool:
    """Whether ``model`` is wrapped by DDP or sharded by FSDP (1 or 2): it averages gradients over ranks."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return True
    fsdp = sys.modules.get("torch.distributed.fsdp")  # never imported: no FSDP model exists
    return fsdp is not None and isinstance(model, (fsdp.FSDPModule, fsdp.FullyShardedDataParallel))


def without_non_finite(value: Any) -> Any:
    """``value`` with every NaN or infinite float, however deep, replaced by ``None``."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {k: without_non_finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [without_non_finite(v) for v in value]
    return value


def strict_json(value: Any, indent: int | None = None) -> str:
    """``value`` as strict JSON text: non-finite floats become ``null``."""
    return json.dumps(without_non_finite(value), indent=indent, allow_nan=False)


def open_jsonl(path: Path) -> IO[str]:
    """``path`` opened to append JSON lines, the first of them on a line of its own.

    A writer killed mid-line leaves a last line without its newline, which no reader can parse;
    appending after it would join the next record to it and lose both. That cut-off line is
    dropped first.
    """
    with path.open("a+b") as file:
        size = file.seek(0, 2)
        if size:
            file.seek(max(0, size - 65536))
            tail = file.read()
            if not tail.endswith(b"\n"):
                cut = tail.rfind(b"\n")
                file.truncate(size - len(tail) + cut + 1 if cut >= 0 else (0 if size <= 65536 else size))
    return path.open("a", encoding="utf-8")


def append_line(path: Path, line: str) -> None:
    """Append ``line`` (ending in a newline) to the JSON-lines file ``path`` (see ``open_jsonl``)."""
    with open_jsonl(path) as file:
        file.write(line)


#: The files of the state-machine library trainloop runs on, and of trainloop: never the line a warning points at.
_MACHINERY, _TRAINLOOP = (
    str(Path(str(module.__file__)).resolve().parent) + os.sep for module in (transitions, sys.modules["trainloop"])
)
_LIBRARY_FILES = (_MACHINERY, _TRAINLOOP)


def warn_user(message: str, category: type[Warning], *, every_rank: bool = False) -> None:
    """Warn, pointing at the user's code, once per run (not once per rank).

    The warning's location is the first frame outside trainloop (and ``transitions``): the user's
    call of ``train()``, or their hook's line, never a line of trainloop's source. Where none is
    outside (the ``trainloop`` command line), it names no source line. Every rank would say the same,
    so under a process group (or ``torchrun``, before one exists) only rank 0 says it; a warning
    about this rank alone (``every_rank``) is said by each rank, with its rank.

    Args:
        message: What to say.
        category: The warning's class.
        every_rank: Whether the warning is about this rank's own work.
    """
    this_rank = rank() if in_process_group() else int(os.environ.get("RANK", "0") or 0)
    if this_rank != 0 and not every_rank:
        return
    if every_rank and (in_process_group() or "RANK" in os.environ):
        message = f"rank {this_rank}: {message}"
    frame: FrameType | None = sys._getframe(1)
    level = 2  # warn_user's caller
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARY_FILES):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


def user_traceback(tb: TracebackType | None) -> TracebackType | None:
    """An error's traceback from a trainloop entry point, as the user needs it.

    Its first frame (the entry point, such as ``_run_machine``), then from the first frame of the
    user's code on (their hook, ``forward``, ``build_model``...): the loop's and the state
    machine's frames in between (about 20 of ``transitions`` alone) say nothing about the error.
    Without a frame of the user's (an error of trainloop's own), only the frames of
    ``transitions`` are left out.
    """
    entries: list[TracebackType] = []
    while tb is not None:
        entries.append(tb)
        tb = tb.tb_next
    files = [entry.tb_frame.f_code.co_filename for entry in entries]
    first = next((i for i, file in enumerate(files) if i and not file.startswith(_LIBRARY_FILES)), 0)
    kept = [e for i, e in enumerate(entries) if i == 0 or (i >= first and not files[i].startswith(_MACHINERY))]
    shown = None
    for entry in reversed(kept):
        shown = TracebackType(shown, entry.tb_frame, entry.tb_lasti, entry.tb_lineno)
    return shown
