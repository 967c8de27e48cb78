"""``StatsHook``: training statistics aggregated over microsteps, steps and ranks.

It is the shared core of ``LoggingHook`` and
``ProgressHook``: both subclass it and override only
``StatsHook.emit``, which receives each new ``TrainingStats``.

Cost: on a step that does not emit, the hook appends references to the step's tensors and adds
a few floats; no tensor is read. At an emission the window's losses and gradient norms are
reduced on their device and read together, and the tensors inside ``forward``'s records are
read in one batch per device and dtype; the items the steps trained on are summed on their device
and read once (``Throughput``, ``ItemCount``: docs/throughput.md).

Steps ``torch.compile`` spent compiling (``step_info.compiled``, see ``trainloop.core.compiling``) are
counted apart: their time is in ``compile_time``, not in ``step_time``'s mean nor the throughput.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from pydantic import validate_call

from trainloop.core.run_state import SINGLE
from trainloop.distributed.ranks import gather_from_ranks, world_size
from trainloop.hook_machinery.base import BaseHook
from trainloop.hook_machinery.registry import register_hook
from trainloop.hook_machinery.schedule import Schedule
from trainloop.settings.types import PositiveFloat, PositiveInt, RecordKey, StrictBool
from trainloop.utils import Records, key_average

if TYPE_CHECKING:
    from trainloop.core.run_state import TrainerView
    from trainloop.step_info import StepInfo

__all__ = [
    "THROUGHPUT_SETTINGS",
    "ItemCount",
    "StatsHook",
    "Throughput",
    "TrainingStats",
    "adopted_throughput",
    "combine_throughput",
    "throughput",
]

_PEAK_WITHOUT_FLOPS = "peak_flops needs flops_per_item: the utilisation is the model's FLOP/s over the peak"



# -- throughput: items per second, counted on the device, read only at an emission --------------


@dataclass(frozen=True)
class Throughput:
    """Items per second over the steps of one emission.

    Attributes:
        items: Items this rank trained on in the window's timed steps (compiling ones left out).
        seconds: Those steps' time on this rank.
        items_per_second: ``items / seconds``.
        flops_per_second: The model's FLOP/s (``items_per_second * flops_per_item``), when declared.
        mfu: ``flops_per_second / peak_flops``, when both are declared.
        total_items: Items over all ranks (a synced hook under a process group), else ``None``.
        total_items_per_second: The ranks' rates added up, else ``None``.
    """

    items: float
    seconds: float
    items_per_second: float
    flops_per_second: float | None = None
    mfu: float | None = None
    total_items: float | None = None
    total_items_per_second: float | None = None

    def to_records(self) -> dict[str, float]:
        """The numbers, under the keys ``metrics.jsonl`` uses (``None`` ones left out)."""
        out = {
            "items": self.items,
            "items_per_second": self.items_per_second,
            "flops_per_second": self.flops_per_second,
            "mfu": self.mfu,
            "total_items": self.total_items,
            "total_items_per_second": self.total_items_per_second,
        }
        return {key: value for key, value in out.items() if value is not None}


class ItemCount:
    """The items of a window's steps: references per step, one read per emission.

    Args:
        key: A key of ``forward``'s records holding each batch's count (dotted for a nested
            one: ``"tokens.input"``), or ``None`` for ``Loss.count``.
        owner: How errors name the hook.
    """

    def __init__(self, key: str | None, owner: str) -> None:
        self.key = key
        self._path = tuple(key.split(".")) if key else ()
        self.owner = owner
        self.counts: list[torch.Tensor | float] = []  # the window's counts: numbers, or tensors on their device

    def reset(self) -> None:
        """Start a new window."""
        self.counts = []

    def add(self, info: StepInfo, trainer: Any) -> None:
        """Add a step's counts (references: no tensor is read, nothing is summed per step).

        ``trainer`` is read only to name the step in an error.

        Raises:
            KeyError: ``key`` is declared and a microstep's records lack it.
        """
        if self.key is None:
            self.counts.extend(info.items)
        else:
            self.counts.extend([self._lookup(record, trainer) for record in info.records])

    def _lookup(self, record: Mapping[str, Any], trainer: Any) -> Any:
        value: Any = record
        for part in self._path:
            if not isinstance(value, Mapping) or part not in value:
                raise KeyError(
                    f"{self.owner}(items={self.key!r}): forward's records at step {trainer.step} have no "
                    f"{self.key!r} (keys: {sorted(record)})"
                )
            value = value[part]
        return value

    def read(self) -> float | None:
        """The window's items (one host sync when any count is a tensor), or ``None`` if no step had a count."""
        if not self.counts:
            return None
        tensors = [t if t.ndim == 0 else t.reshape(()) for t in self.counts if isinstance(t, torch.Tensor)]
        total = float(sum(n for n in self.counts if not isinstance(n, torch.Tensor)))
        if tensors:
            # Two ops for the window, whatever its length: stacked where they are (dtypes promote),
            # summed in float64 (exact for integer counts below 2**53), read once.
            total += torch.stack(tensors).detach().sum(dtype=torch.float64).item()
        return total


THROUGHPUT_SETTINGS = ("items", "flops_per_item", "peak_flops")
"""What a statistics hook is told about the items it counts: declared once, shown by every such hook."""


def adopted_throughput(own: Any, other: Any) -> dict[str, Any]:
    """The throughput settings ``own`` takes from ``other``: those it left unset and ``other`` declares.

    Raises:
        ValueError: Both declare one of them, differently (the message names it and both values).
    """
    adopted = {}
    for name in THROUGHPUT_SETTINGS:
        mine, theirs = getattr(own, name, None), getattr(other, name, None)
        if theirs is None:
            continue
        if mine is None:
            adopted[name] = theirs
        elif mine != theirs:
            said = f"{name} is {mine!r} on one and {theirs!r} on the other"
            raise ValueError(f"{said}: declare it once, on the LoggingHook")
    return adopted


def throughput(
    items: float | None, seconds: float, flops_per_item: float | None, peak_flops: float | None
) -> Throughput | None:
    """This rank's ``Throughput``, or ``None`` when nothing was counted or timed."""
    if items is None or seconds <= 0:
        return None
    rate = items / seconds
    flops = rate * flops_per_item if flops_per_item is not None else None
    mfu = flops / peak_flops if flops is not None and peak_flops is not None else None
    return Throughput(items, seconds, rate, flops, mfu)


def combine_throughput(ranks: Sequence[Throughput | None], local: Throughput | None) -> Throughput | None:
    """``local`` with the totals over ``ranks`` (every rank's ``Throughput``, gathered)."""
    counted = [t for t in ranks if t is not None]
    if local is None or not counted:
        return local
    mfus = [t.mfu for t in counted if t.mfu is not None]
    return Throughput(
        items=local.items,
        seconds=local.seconds,
        items_per_second=local.items_per_second,
        flops_per_second=local.flops_per_second,
        mfu=sum(mfus) / len(mfus) if mfus else None,
        total_items=sum(t.items for t in counted),
        total_items_per_second=sum(t.items_per_second for t in counted),
    )


@dataclass(frozen=True)
class TrainingStats:
    """What a ``StatsHook`` emits: the steps since its previous emission, aggregated.

    Attributes:
        step: The step at which these were emitted (the last step aggregated).
        steps: How many steps were aggregated (on this rank).
        loss: Mean loss over every microstep of those steps (then over ranks, when synced).
        grad_norm: Mean total gradient norm, as measured before clipping; ``None`` when the
            trainer does not clip (no ``grad_clip``).
        step_time: Mean seconds per step (``step_info.step_time``), steps spent compiling left
            out (unless every step of the window compiled: then theirs).
        data_time: Mean seconds per step spent drawing batches (all microsteps of a step).
        non_finite_grad_retries: How many times these steps were retried for non-finite
            gradients (the maximum over ranks, when synced: ranks retry the same steps).
        max_memory: Peak of ``step_info["max_memory"]`` over these steps (and ranks), in the
            unit the recording hook uses (GiB for
            ``CudaMaxMemoryHook``); ``None`` when no hook
            records it.
        lrs: Learning rate of each optimizer param group at the last step, as the optimizer
            used it (before the scheduler stepped), keyed by the group's ``"name"`` entry or
            ``group_<i>``; with several optimizers, by the optimizer's name (and
            ``<optimizer>/<group>`` for one with several groups).
        losses: With several optimizers, the mean loss of each one's updates, by name (``loss``
            is then the mean over every microstep of every update).
        grad_norms: With several optimizers and clipping, each one's mean norm, by name.
        records: ``forward``'s records averaged key by key over every microstep (then over
            ranks); empty when the hook does not collect them.
        throughput: Items per second (``Throughput``); ``None`` when nothing
            was counted (plain losses and no ``items`` key declared) or every step compiled.
        compile_steps: How many of these steps ``torch.compile`` spent compiling (the most over
            ranks, when synced).
        compile_time: Those steps' seconds (the mean over ranks, when synced).
        recompilations: How many of them recompiled (the most over ranks, when synced).
    """

    step: int
    steps: int
    loss: float
    grad_norm: float | None
    step_time: float
    data_time: float
    non_finite_grad_retries: int
    max_memory: float | None
    lrs: dict[str, float] = field(default_factory=dict)
    losses: dict[str, float] = field(default_factory=dict)
    grad_norms: dict[str, float] = field(default_factory=dict)
    records: Records = field(default_factory=dict)
    throughput: Throughput | None = None
    compile_steps: int = 0
    compile_time: float = 0.0
    recompilations: int = 0

    def to_records(self) -> dict[str, Any]:
        """These statistics as nested records for ``trainer.log``.

        Keys: ``loss``, ``grad_norm`` (when clipping), ``lr`` (a dict by param group; with several
        optimizers, ``loss``, ``grad_norm`` and ``lr`` are dicts by optimizer: ``loss/generator``),
        ``step_time``, ``data_time``, ``non_finite_grad_retries``, ``max_memory`` (when
        recorded), ``throughput`` (``items_per_second`` and the rest of ``Throughput``, when
        counted), ``compile_steps``, ``compile_time`` and ``recompilations`` (when a step
        compiled) and ``records`` (``forward``'s averaged records, when any). Keeping the
        user's records under their own key means no name of theirs can collide with ours.
        """
        out: dict[str, Any] = {"loss": dict(self.losses) if self.losses else self.loss}
        if self.grad_norms:
            out["grad_norm"] = dict(self.grad_norms)
        elif self.grad_norm is not None:
            out["grad_norm"] = self.grad_norm
        out["lr"] = dict(self.lrs)
        out["step_time"] = self.step_time
        out["data_time"] = self.data_time
        out["non_finite_grad_retries"] = self.non_finite_grad_retries
        if self.max_memory is not None:
            out["max_memory"] = self.max_memory
        if self.throughput is not None:
            out["throughput"] = self.throughput.to_records()
        if self.compile_steps:
            out["compile_steps"] = self.compile_steps
            out["compile_time"] = self.compile_time
            out["recompilations"] = self.recompilations
        if self.records:
            out["records"] = self.records
        return out


@register_hook("stats")
class StatsHook(BaseHook):
    """Aggregate training statistics and emit them every ``interval`` steps.

    Every step it collects the loss of each microstep, the gradient norm (when the trainer
    clips), step and data time, the retry count, ``step_info["max_memory"]`` when another hook
    records it (that hook must come before this one), ``forward``'s records, and each param
    group's learning rate before the scheduler steps. On its ``schedule``, the ``every(n)`` rule
    (``trainloop.hooks.Schedule``: every multiple of ``interval`` and the last step of a run that ends
    cleanly, also early on an exit request), ``on_schedule`` reduces them into a
    ``TrainingStats`` and calls ``emit``.

    Used on its own, the hook keeps the newest statistics in ``latest`` and publishes
    them as ``trainer.step_info["stats"]`` on the steps where it emits, for later hooks to read.
    Subclasses (``LoggingHook``,
    ``ProgressHook``) override ``emit``.

    Args:
        interval: Emit at every multiple of this many steps, and at the last step.
        sync: When a ``torch.distributed`` process group is initialised with more than one
            rank, average the statistics across ranks (one ``all_gather_object`` per emission,
            so every rank must run this hook with the same ``interval``; with NCCL, set the
            rank's CUDA device first, as usual).
        items: The key of ``forward``'s records that holds each batch's item count (tokens,
            say; dotted for a nested key), or ``None`` to count ``Loss.count``.
        flops_per_item: The model's FLOPs per item (forward and backward), to report FLOP/s.
        peak_flops: The device's peak FLOP/s, to report the model-FLOPs utilisation (MFU);
            needs ``flops_per_item``. No table of devices is built in: declare your device's.

    Attributes:
        latest: The last ``TrainingStats`` emitted, or ``None``.

    Raises:
        pydantic.ValidationError: A parameter is invalid; the error names it.
    """

    #: Whether to keep ``forward``'s records; a subclass that never shows them turns it off,
    #: which spares reading their tensors at each emission.
    collect_records: bool = True

    @validate_call
    def __init__(
        self,
        interval: PositiveInt = 10,
        sync: StrictBool = True,
        items: RecordKey | None = None,
        flops_per_item: PositiveFloat | None = None,
        peak_flops: PositiveFloat | None = None,
    ) -> None:
        if peak_flops is not None and flops_per_item is None:
            raise ValueError(_PEAK_WITHOUT_FLOPS)
        self.interval = interval
        self.sync = sync
        self.items = items
        self.flops_per_item = flops_per_item
        self.peak_flops = peak_flops
        self._items = ItemCount(items, type(self).__name__)
        self.latest: TrainingStats | None = None
        self.schedule = Schedule(interval)
        self._max_steps = 0
        self._optimizers: dict[str, Any] = {}
        self._lr_names: dict[str, list[str]] = {}  # per optimizer, its groups' keys
        self._lrs: dict[str, list[Any]] = {}  # per optimizer, its groups' last learning rates
        self._reset_window()

    def _reset_window(self) -> None:
        self._steps = 0
        self._losses: list[torch.Tensor] = []
        self._grad_norms: list[torch.Tensor] = []
        self._losses_by: dict[str, list[torch.Tensor]] = {}  # several optimizers only
        self._grad_norms_by: dict[str, list[torch.Tensor]] = {}
        self._records: list[Mapping[str, Any]] = []
        self._step_time = 0.0  # of the steps that did not compile
        self._compile_steps = 0
        self._compile_time = 0.0
        self._recompilations = 0
        self._items.reset()
        self._data_time = 0.0
        self._retries = 0
        self._max_memory: float | None = None

    @classmethod
    def check_settings(cls, declared: Any, settings: Any, trainer: Any) -> list[tuple[str | None, str]]:
        """``peak_flops`` comes with ``flops_per_item`` (see ``BaseHook.check_settings``)."""
        if getattr(declared, "peak_flops", None) is not None and getattr(declared, "flops_per_item", None) is None:
            return [("peak_flops", _PEAK_WITHOUT_FLOPS)]
        return []

    # -- collecting ------------------------------------------------------------------------

    def on_before_train(self, trainer: TrainerView) -> None:
        """Start an empty window."""
        self._max_steps = trainer.max_steps
        self._optimizers = trainer.optimizers  # built, and not replaced during a run: read once
        self._lr_names, self._lrs = {}, {}
        self.latest = None
        self._reset_window()

    def on_before_optimizer_step(self, trainer: TrainerView) -> None:
        """Capture each param group's learning rate: the one this step uses."""
        # The scheduler steps right after the optimizer, so this is the last moment the lr is
        # the step's own. It is stored into a list kept across steps: no allocation per step.
        # (param_groups is read each time: loading a state dict replaces the list.)
        name = trainer.updating
        groups = self._optimizers[name].param_groups
        lrs = self._lrs.get(name)
        if lrs is None or len(lrs) != len(groups):
            lrs = self._name_param_groups(name, groups)
        for i, group in enumerate(groups):
            lr = group["lr"]
            # Schedulers update a tensor lr in place, so keep a copy of this step's value.
            lrs[i] = lr.detach().clone() if isinstance(lr, torch.Tensor) else lr

    def _name_param_groups(self, optimizer: str, groups: list[dict[str, Any]]) -> list[Any]:
        names: list[str] = []
        for i, group in enumerate(groups):
            name = str(group.get("name", f"group_{i}"))
            names.append(f"{name}_{i}" if name in names else name)
        if list(self._optimizers) != [SINGLE]:  # optimizers by name: learning rates keyed by optimizer
            names = [optimizer] if len(names) == 1 else [f"{optimizer}/{name}" for name in names]
        self._lr_names[optimizer] = names
        lrs = self._lrs[optimizer] = [None] * len(groups)
        return lrs

    def on_after_step(self, trainer: TrainerView) -> None:
        """Add the step to the window (``on_schedule`` emits it when due)."""
        info = trainer.step_info
        self._steps += 1
        # References only: reading a tensor here would be a host sync on every step.
        self._losses.extend(info.loss)
        grad_norm = info.grad_norm
        if grad_norm is not None:
            self._grad_norms.append(grad_norm)
        if info.losses:  # several optimizers
            for name, losses in info.losses.items():
                self._losses_by.setdefault(name, []).extend(losses)
            for name, norm in info.grad_norms.items():
                self._grad_norms_by.setdefault(name, []).append(norm)
        if self.collect_records:
            self._records.extend(info.records)
        step_time = info.step_time or 0.0
        compiled = info.compiled
        if compiled is None:
            self._step_time += step_time
            self._items.add(info, trainer)
        else:  # compiling is not the model's speed
            self._compile_steps += 1
            self._compile_time += step_time
            self._recompilations += compiled.recompilation
        self._data_time += sum(info.data_time)
        self._retries += info.non_finite_grad_retries
        memory = info.extras.get("max_memory")
        if memory is not None and (self._max_memory is None or memory > self._max_memory):
            self._max_memory = memory

    def on_schedule(self, trainer: TrainerView) -> None:
        """Emit the steps since the last emission.

        At a multiple of ``interval``, or the last step of a run that ended cleanly (never after an error: with ``sync``
        the other ranks may not get here, and the collective would hang).
        """
        if self._steps:
            self._emit_window(trainer)

    # -- reducing --------------------------------------------------------------------------

    def _emit_window(self, trainer: TrainerView) -> None:
        stats = self._reduce(trainer.step)
        if self.sync and world_size() > 1:
            stats = _combine_ranks(stats)
        self._reset_window()
        self.latest = stats
        self.emit(trainer, stats)

    def _reduce(self, step: int) -> TrainingStats:
        steps = self._steps
        loss = torch.stack(self._losses).float().mean()
        by_name = [*self._losses_by.values(), *self._grad_norms_by.values()]
        means = [loss, *(torch.stack(values).float().mean().to(loss.device) for values in by_name)]
        if self._grad_norms:
            means.append(torch.stack(self._grad_norms).float().mean().to(loss.device))
        # The window's host sync for its tensors: every mean read at once.
        values = torch.stack(means).tolist() if len(means) > 1 else [loss.item()]
        loss_value = values[0]
        grad_norm_value = values[-1] if self._grad_norms else None
        losses = dict(zip(self._losses_by, values[1:], strict=False))
        grad_norms = dict(zip(self._grad_norms_by, values[1 + len(losses):], strict=False))
        records = key_average(_read_scalar_tensors(self._records)) if self._records else {}
        timed = steps - self._compile_steps
        return TrainingStats(
            step=step,
            steps=steps,
            loss=loss_value,
            grad_norm=grad_norm_value,
            step_time=self._step_time / timed if timed else self._compile_time / steps,
            data_time=self._data_time / steps,
            non_finite_grad_retries=self._retries,
            max_memory=self._max_memory,
            lrs={
                key: float(lr)
                for optimizer, lrs in self._lrs.items()
                for key, lr in zip(self._lr_names[optimizer], lrs, strict=True)
            },
            losses=losses,
            grad_norms=grad_norms,
            records=records,
            throughput=throughput(self._items.read(), self._step_time, self.flops_per_item, self.peak_flops),
            compile_steps=self._compile_steps,
            compile_time=self._compile_time,
            recompilations=self._recompilations,
        )

    def emit(self, trainer: TrainerView, stats: TrainingStats) -> None:
        """Receive each new aggregate; the base class publishes it as ``step_info["stats"]``.

        Args:
            trainer: The trainer.
            stats: The statistics of the steps since the previous emission.
        """
        trainer.step_info["stats"] = stats


def _combine_ranks(local: TrainingStats) -> TrainingStats:
    """Average ``local`` with the other ranks' statistics (a collective: all ranks call it)."""
    ranks = [s for s in gather_from_ranks(local) if s is not None]
    n = len(ranks)
    norms = [s.grad_norm for s in ranks if s.grad_norm is not None]
    memories = [s.max_memory for s in ranks if s.max_memory is not None]
    return TrainingStats(
        step=local.step,
        steps=local.steps,
        loss=sum(s.loss for s in ranks) / n,
        grad_norm=sum(norms) / len(norms) if norms else None,
        step_time=sum(s.step_time for s in ranks) / n,
        data_time=sum(s.data_time for s in ranks) / n,
        non_finite_grad_retries=max(s.non_finite_grad_retries for s in ranks),
        max_memory=max(memories) if memories else None,
        lrs=local.lrs,
        losses={name: sum(s.losses[name] for s in ranks) / n for name in local.losses},
        grad_norms={name: sum(s.grad_norms[name] for s in ranks) / n for name in local.grad_norms},
        records=key_average([s.records for s in ranks]) if any(s.records for s in ranks) else {},
        throughput=combine_throughput([s.throughput for s in ranks], local.throughput),
        compile_steps=max(s.compile_steps for s in ranks),
        compile_time=sum(s.compile_time for s in ranks) / n,
        recompilations=max(s.recompilations for s in ranks),
    )


def _read_scalar_tensors(records: list[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """``records`` with every one-element tensor replaced by its number.

    ``key_average`` would call ``.item()`` on each tensor, one host sync per value and
    microstep; here they are stacked and read once per (device, dtype). Tensors of another
    size are left in place for ``key_average`` to reject with the key's name.
    """
    found: list[torch.Tensor] = []
    for record in records:
        _collect_scalar_tensors(record, found)
    if not found:
        return records
    numbers = iter(_read_together(found))
    return [_with_numbers(record, numbers) for record in records]


def _is_scalar_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.numel() == 1


def _collect_scalar_tensors(record: Mapping[str, Any], found: list[torch.Tensor]) -> None:
    """Append ``record``'s one-element tensors to ``found``, depth first, in the record's order."""
    for value in record.values():
        if isinstance(value, Mapping):
            _collect_scalar_tensors(value, found)
        elif _is_scalar_tensor(value):
            found.append(value)


def _read_together(found: list[torch.Tensor]) -> list[Any]:
    """The numbers of ``found``, in order, read with one host sync per (device, dtype)."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, tensor in enumerate(found):
        groups.setdefault((tensor.device, tensor.dtype), []).append(i)
    values: list[Any] = [None] * len(found)
    for indices in groups.values():
        read = torch.stack([found[i].detach().reshape(()) for i in indices]).tolist()
        for i, value in zip(indices, read, strict=True):
            values[i] = value
    return values


def _with_numbers(record: Mapping[str, Any], numbers: Iterator[Any]) -> dict[str, Any]:
    """A copy of ``record`` whose one-element tensors are the next of ``numbers``, in collection order."""
    out: dict[str, Any] = {}
    for key, value in record.items():
        if isinstance(value, Mapping):
            out[key] = _with_numbers(value, numbers)
        elif _is_scalar_tensor(value):
            out[key] = next(numbers)
        else:
            out[key] = value
    return out
