"""A trainer whose module registers hooks the preflight refuses, for the CLI's preflight tests.

``typo_printer`` misspells a hook method; ``silent_printer`` declares a schedule and nothing to call when
it is due; ``every_printer`` takes its ``every`` as any number, so
that only the ``Schedule`` it makes can refuse ``2.5``.

Imported only by the ``trainloop`` subprocesses that name it (``--trainer
typo_hook_trainer:TypoHookTrainer``), so the hook type is registered in those processes alone.
"""

from __future__ import annotations

from cli_trainers import CliTrainer

from trainloop import BaseHook, register_hook
from trainloop.hooks import Schedule


@register_hook("typo_printer")
class TypoPrinter(BaseHook):
    """Prints the step after each step, had its method been named ``on_after_step``."""

    def on_after_steps(self, trainer):
        print(trainer.step)


@register_hook("silent_printer")
class SilentPrinter(BaseHook):
    """Would print every 2 steps, had it an ``on_schedule``."""

    def __init__(self) -> None:
        self.schedule = Schedule(every=2)


@register_hook("every_printer")
class EveryPrinter(BaseHook):
    """Prints the step every ``every`` steps."""

    def __init__(self, every: float = 1) -> None:
        self.schedule = Schedule(every)  # type: ignore[arg-type]  # a float on purpose: the Schedule refuses it

    def on_schedule(self, trainer):
        print(trainer.step)


class TypoHookTrainer(CliTrainer):
    """CliTrainer, declared in a module that registers ``typo_printer``."""
