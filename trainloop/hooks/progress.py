"""``ProgressHook``: training progress as log lines, or as a live bar on a terminal."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Sequence
from datetime import timedelta
from time import perf_counter
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from pydantic import validate_call

from trainloop.distributed.ranks import is_rank_zero
from trainloop.hook_machinery.registry import register_hook
from trainloop.hooks.logging_hook import LoggingHook
from trainloop.hooks.stats import THROUGHPUT_SETTINGS, ItemCount, StatsHook, TrainingStats, adopted_throughput
from trainloop.settings.types import NonNegativeInt, PositiveFloat, PositiveInt, RecordKey, StrictBool
from trainloop.utils import flatten_nested_dict

if TYPE_CHECKING:
    from trainloop.core.run_state import TrainerView

__all__ = ["ProgressHook"]

_FALLBACK_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}, {rate_fmt}{postfix}]"


@register_hook("progress")
class ProgressHook(StatsHook):
    """Report training progress every ``interval`` steps.

    Each report is a line logged at INFO through ``trainer.logger``::

        Step 100/10000: step 0.2500s data 0.0100s eta 6:00:00 loss 0.5234 grad_norm 2.3456 lr 1.00e-03

    ``eta`` appears once ``eta_warmup`` steps have run (steps ``torch.compile`` spent compiling
    are left out of its pace; ``compiling`` names them); ``items/s`` when the steps' items are
    counted (``Loss.count`` or the declared ``items``; ``total items/s`` across ranks when synced,
    ``mfu`` with ``flops_per_item`` and ``peak_flops``); ``mem`` when a hook records peak
    memory (``step_info["max_memory"]``, in GiB as
    ``CudaMaxMemoryHook`` records it); ``grad_norm`` when the
    trainer clips; ``retries`` when steps were retried; ``lr/<group>`` per group when the
    optimizer has several; ``| key value ...`` with ``with_records``. The numbers are the
    ``StatsHook`` aggregate of the steps since the last report. Reports follow the
    ``every(n)`` rule (``trainloop.hooks.Schedule``).

    When standard output is a terminal, ``bar`` is on, ``tqdm`` is installed and this is rank 0,
    a live progress bar is drawn there (its postfix carries the same numbers, and the latest
    values logged under the ``show_logged`` keys, such as a ``ValidationHook``'s ``val/...``,
    as they are logged), and console log handlers on the root logger write above the bar while
    it runs (the validation hook's own line among them). The bar replaces the lines only when
    standard error, where the log goes, is that terminal too: a redirected standard error
    (``trainloop run run.json 2> train.log``, a job log) gets the lines, so the log is complete,
    and a non-interactive standard output (a file, a pipe) gets no bar.

    If no logging handler is configured anywhere on ``trainer.logger``'s way to the root
    logger, Python would show only warnings (its last-resort handler), and the lines would be
    lost. The hook then attaches, on rank 0 and for the duration of the run, a ``StreamHandler``
    to standard error on ``trainer.logger``, and sets that logger's level to INFO if it had
    none; both are undone when training ends. A configured setup is never touched.

    Args:
        interval: Report at every multiple of this many steps, and at the last step.
        with_records: Add ``forward``'s records, averaged, to each report.
        sync: Average across ranks when a ``torch.distributed`` process group is initialised
            (a collective at each report: every rank must run this hook).
        eta_warmup: Steps to run before estimating the time left; the estimate is the mean
            wall time per step since then, times the steps remaining.
        show_units: Write units (``s``, ``GiB``) after the numbers.
        bar: Allow the live bar on a terminal; ``False`` always logs lines.
        show_logged: Top-level keys of ``trainer.log`` records whose latest values the bar shows
            (default: ``["val"]``, a ``ValidationHook``'s results).
        items: As ``StatsHook``: the records key of each batch's item count, or ``None`` for ``Loss.count``.
        flops_per_item: As ``StatsHook``: the model's FLOPs per item, for FLOP/s and the MFU.
        peak_flops: As ``StatsHook``: the device's peak FLOP/s, for the MFU.

    Those three are declared once: left unset here, they are the run's ``LoggingHook``'s, so the
    line shows what the metrics record. Set here too, they must be the same (else the run is
    refused before it starts).

    Raises:
        pydantic.ValidationError: A parameter is invalid; the error names it.
    """

    @validate_call
    def __init__(
        self,
        interval: PositiveInt = 1,
        with_records: StrictBool = False,
        sync: StrictBool = False,
        eta_warmup: NonNegativeInt = 10,
        show_units: StrictBool = True,
        bar: StrictBool = True,
        show_logged: list[str] | None = None,
        items: RecordKey | None = None,
        flops_per_item: PositiveFloat | None = None,
        peak_flops: PositiveFloat | None = None,
    ) -> None:
        super().__init__(
            interval=interval, sync=sync, items=items, flops_per_item=flops_per_item, peak_flops=peak_flops
        )
        # As declared: what a LoggingHook's settings fill in at each run (see on_before_train).
        self._declared = SimpleNamespace(items=items, flops_per_item=flops_per_item, peak_flops=peak_flops)
        self.with_records = with_records
        self.collect_records = with_records
        self.eta_warmup = eta_warmup
        self.show_units = show_units
        self.bar = bar
        self.show_logged = tuple(["val"] if show_logged is None else show_logged)
        self._logged: dict[str, float] = {}
        self._postfix = ""
        self._steps_run = 0
        self._eta_start: float | None = None
        self._eta_excluded = (0, 0.0)  # steps spent compiling since the ETA clock started, and their time
        self._bar: Any = None
        self._lines = True  # whether reports are logged as lines (with or without the bar)
        self._cleanup = contextlib.ExitStack()

    @classmethod
    def check_together(cls, declared: Sequence[tuple[int, Any]], settings: Any) -> list[str]:
        """Each progress hook's throughput settings agree with each declared ``LoggingHook``'s."""
        logging_hooks = [(j, spec) for j, spec in enumerate(settings.hooks) if spec.type == "logging"]
        problems = []
        for i, spec in declared:
            for j, other in logging_hooks:
                try:
                    adopted_throughput(spec, other)
                except ValueError as error:
                    problems.append(f"hooks[{i}] (progress) and hooks[{j}] (logging): {error}")
        return problems

    def on_before_train(self, trainer: TrainerView) -> None:
        """Take the run's ``LoggingHook``'s throughput settings, start the ETA clock, open the bar (or show the lines).

        Raises:
            ValueError: This hook and the ``LoggingHook`` declare different throughput settings.
        """
        self._adopt_throughput(trainer.hooks)
        super().on_before_train(trainer)
        self._steps_run = 0
        self._eta_start = perf_counter() if self.eta_warmup == 0 else None
        self._eta_excluded = (0, 0.0)
        self._bar = self._open_bar(trainer) if self.bar else None
        stderr = sys.stderr
        self._lines = self._bar is None or stderr is None or not stderr.isatty()  # a log file keeps the lines
        self._logged, self._postfix = {}, ""
        if self._lines:
            self._make_lines_visible(trainer.logger)

    def _adopt_throughput(self, hooks: Sequence[Any]) -> None:
        """Count and rate items as the run's first ``LoggingHook`` does, where this hook declares nothing."""
        settings = {name: getattr(self._declared, name) for name in THROUGHPUT_SETTINGS}  # a new run starts afresh
        source = next((hook for hook in hooks if isinstance(hook, LoggingHook)), None)
        if source is not None:
            try:
                settings |= adopted_throughput(self._declared, source)
            except ValueError as error:
                raise ValueError(f"ProgressHook and {type(source).__name__}: {error}") from None
        self.items, self.flops_per_item, self.peak_flops = (settings[name] for name in THROUGHPUT_SETTINGS)
        self._items = ItemCount(self.items, type(self).__name__)

    def on_after_step(self, trainer: TrainerView) -> None:
        """Count the step for the ETA, then aggregate (and maybe report) it."""
        self._steps_run += 1
        if self._steps_run == self.eta_warmup:
            self._eta_start = perf_counter()
        elif trainer.step_info.compiled is not None and self._eta_start is not None:
            steps, seconds = self._eta_excluded
            self._eta_excluded = (steps + 1, seconds + (trainer.step_info.step_time or 0.0))
        super().on_after_step(trainer)

    def on_after_train(self, trainer: TrainerView) -> None:
        """Report steps not yet reported, then close the bar and undo any logging set-up."""
        try:
            super().on_after_train(trainer)
        finally:
            self._bar = None
            self._cleanup.close()

    def emit(self, trainer: TrainerView, stats: TrainingStats) -> None:
        """Show one report: update the bar, log a line, or both (a bar on the terminal, standard error redirected)."""
        bar = self._bar
        if bar is not None:
            fmt, args = self._describe(trainer, stats)
            self._postfix = fmt % tuple(args)
            bar.set_postfix_str(self._postfix + self._logged_text(), refresh=False)
            bar.update(trainer.step - bar.n)
        logger = trainer.logger
        if self._lines and logger.isEnabledFor(logging.INFO):
            fmt, args = self._describe(trainer, stats)
            fmt = "Step %d/%d: " + fmt  # a %-format with its arguments: formatted by logging, lazily
            logger.info(fmt, trainer.step, trainer.max_steps, *args)

    def on_log(self, trainer: TrainerView, records: dict[str, Any]) -> None:
        """Show the latest values logged under ``show_logged`` keys in the bar, as they come."""
        bar = self._bar
        if bar is None or not any(key in records for key in self.show_logged):
            return
        last = trainer.metrics.last  # trainer.log recorded them as floats before calling hooks
        for key in self.show_logged:
            if key in records:
                for name in flatten_nested_dict({key: records[key]}):
                    if name in last:
                        self._logged[name] = last[name]
        bar.set_postfix_str(self._postfix + self._logged_text(), refresh=False)
        bar.update(trainer.step - bar.n)  # the bar moves to the step the values belong to
        bar.refresh()  # shown now, not at the next report

    def _logged_text(self) -> str:
        return "".join(f" {name} {value:.4g}" for name, value in self._logged.items())

    def _describe(self, trainer: TrainerView, stats: TrainingStats) -> tuple[str, list[Any]]:
        """The report as a %-format and its arguments (so logging formats it lazily)."""
        seconds = "s" if self.show_units else ""
        parts = [f"step %.4f{seconds}", f"data %.4f{seconds}"]
        args: list[Any] = [stats.step_time, stats.data_time]
        eta = self._eta(trainer)
        if eta is not None:
            parts.append("eta %s")
            args.append(eta)
        if stats.max_memory is not None:
            parts.append("mem %.2fGiB" if self.show_units else "mem %.2f")
            args.append(stats.max_memory)
        _describe_loss(stats, parts, args)
        self._describe_throughput(stats, parts, args)
        if stats.grad_norm is not None:
            parts.append("grad_norm %.4f")
            args.append(stats.grad_norm)
        if stats.non_finite_grad_retries:
            parts.append("retries %d")
            args.append(stats.non_finite_grad_retries)
        if len(stats.lrs) == 1:
            parts.append("lr %.2e")
            args.extend(stats.lrs.values())
        else:
            for name, lr in stats.lrs.items():
                parts.append("lr/%s %.2e")
                args += [name, lr]
        if self.with_records and stats.records:
            parts.append("|")
            for key, value in flatten_nested_dict(stats.records).items():
                parts.append("%s %.4g")
                args += [key, value]
        return " ".join(parts), args

    @staticmethod
    def _describe_throughput(stats: TrainingStats, parts: list[str], args: list[Any]) -> None:
        """Add the throughput and the compile marks to a report."""
        if stats.compile_steps:
            parts.append("compiling %d steps %.1fs" if stats.compile_steps > 1 else "compiling %d step %.1fs")
            args += [stats.compile_steps, stats.compile_time]
        rate = stats.throughput
        if rate is None:
            return
        parts.append("items/s %.4g")
        args.append(rate.items_per_second)
        if rate.total_items_per_second is not None:
            parts.append("total items/s %.4g")
            args.append(rate.total_items_per_second)
        if rate.mfu is not None:
            parts.append("mfu %.2f%%")
            args.append(100 * rate.mfu)

    def _eta(self, trainer: TrainerView) -> timedelta | None:
        excluded_steps, excluded_time = self._eta_excluded
        timed = self._steps_run - self.eta_warmup - excluded_steps
        if self._eta_start is None or timed <= 0:
            return None
        per_step = (perf_counter() - self._eta_start - excluded_time) / timed
        return timedelta(seconds=round(per_step * max(self._max_steps - trainer.step, 0)))

    def _open_bar(self, trainer: TrainerView) -> Any:
        """A tqdm bar on standard output if it is a terminal (rank 0 only), else ``None``."""
        stdout = sys.stdout
        if stdout is None or not stdout.isatty() or not is_rank_zero():
            return None
        try:
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm
        except ImportError:  # the bar is optional; lines then
            return None
        bar = tqdm(
            total=trainer.max_steps,
            initial=trainer.step,
            file=stdout,
            unit="step",
            dynamic_ncols=True,
            bar_format=_BAR_FORMAT,
        )
        self._cleanup.callback(bar.close)
        # Other log lines on the terminal would tear the bar: route them through tqdm.write. A
        # redirected standard error tears nothing, and its handlers are left as they are.
        stderr = sys.stderr
        on_stdout = any(isinstance(h, logging.StreamHandler) and h.stream is stdout for h in logging.root.handlers)
        if on_stdout or (stderr is not None and stderr.isatty()):
            self._cleanup.enter_context(logging_redirect_tqdm([logging.root], tqdm_class=tqdm))
        return bar

    def _make_lines_visible(self, logger: logging.Logger) -> None:
        """Give the lines a handler if logging was never configured (see the class docstring)."""
        if logger.hasHandlers() or not is_rank_zero():
            return
        handler = logging.StreamHandler()  # standard error, as it is now
        handler.setFormatter(logging.Formatter(_FALLBACK_FORMAT))
        logger.addHandler(handler)
        self._cleanup.callback(handler.close)
        self._cleanup.callback(logger.removeHandler, handler)
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.INFO)
            self._cleanup.callback(logger.setLevel, logging.NOTSET)


def _describe_loss(stats: TrainingStats, parts: list[str], args: list[Any]) -> None:
    """The loss, or each optimizer's (several optimizers)."""
    if stats.losses:
        for name, loss in stats.losses.items():
            parts.append("loss/%s %.4f")
            args += [name, loss]
    else:
        parts.append("loss %.4f")
        args.append(stats.loss)
