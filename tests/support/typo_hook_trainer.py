"""A trainer whose module registers a hook with a misspelt method, for the CLI's preflight tests.

Imported only by the ``trainloop`` subprocesses that name it (``--trainer
typo_hook_trainer:TypoHookTrainer``), so the hook type is registered in those processes alone.
"""

from __future__ import annotations

from cli_trainers import CliTrainer

from trainloop import BaseHook, register_hook


@register_hook("typo_printer")
class TypoPrinter(BaseHook):
    """Prints the step after each step, had its method been named ``on_after_step``."""

    def on_after_steps(self, trainer):
        print(trainer.step)


class TypoHookTrainer(CliTrainer):
    """CliTrainer, declared in a module that registers ``typo_printer``."""
