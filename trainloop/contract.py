"""``Contract``: the methods a trainer subclass writes, with their defaults (``BaseTrainer`` inherits them).

``build_data_loader``, ``build_model``, ``forward`` and (unless ``settings.optimizer`` is declared)
``build_optimizer`` make a trainer that trains; ``build_predict_data_loader`` and ``predict_step``
one that predicts. The other ``build_*`` methods have defaults read from the settings.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from trainloop.nested import Records
from trainloop.run_state import Built
from trainloop.settings import optimizer as components

if TYPE_CHECKING:
    from trainloop.hooks.base import BaseHook
    from trainloop.settings.model import TrainerSettings

__all__ = ["Contract"]


class Contract:
    """The user's contract: what a ``BaseTrainer`` subclass implements, and the optional methods' defaults.

    The run calls these in ``building`` (the ``build_*`` methods) and in each microstep (``forward``).
    What the ``build_*`` methods return, the loop holds; the trainer shows it as ``data_loader``,
    ``model``, ``optimizer``, ``lr_scheduler`` and ``grad_scaler`` (see ``trainloop.run_state.Built``).

    Attributes:
        settings: The validated settings (``BaseTrainer`` sets them).
        device: The device of the run (``settings.device``, else torch's default).
    """

    settings: TrainerSettings
    device: torch.device

    # Built in ``building``, in this order, by the ``build_*`` methods; the loop holds them.
    data_loader: Built[Iterable[Any]] = Built()
    model: Built[nn.Module] = Built()
    optimizer: Built[torch.optim.Optimizer] = Built()
    lr_scheduler: Built[torch.optim.lr_scheduler.LRScheduler | None] = Built()
    grad_scaler: Built[torch.amp.GradScaler] = Built()

    if TYPE_CHECKING:  # BaseTrainer's: the run's length

        @property
        def max_steps(self) -> int:
            """The run's last step (``BaseTrainer.max_steps``)."""

    def build_data_loader(self) -> Iterable[Any]:
        """Return the training data: an infinite iterator or a re-iterable such as a DataLoader."""
        raise NotImplementedError(f"{type(self).__name__} must implement build_data_loader()")

    def build_model(self) -> nn.Module:
        """Return the model, on its device and already wrapped (DDP, FSDP) if wanted."""
        raise NotImplementedError(f"{type(self).__name__} must implement build_model()")

    def build_optimizer(self) -> torch.optim.Optimizer:
        """Return the optimizer of ``self.model``'s parameters.

        By default, the one declared in ``settings.optimizer``.
        """
        if self.settings.optimizer is None:
            raise NotImplementedError(
                f"{type(self).__name__} must implement build_optimizer() or declare settings.optimizer"
            )
        return components.build_optimizer(self.settings.optimizer, self.model)

    def build_lr_scheduler(self) -> torch.optim.lr_scheduler.LRScheduler | None:
        """Return a learning-rate scheduler stepped after every optimizer step, or ``None``.

        By default, the one declared in ``settings.lr_schedule``, if any.
        """
        if self.settings.lr_schedule is None:
            return None
        return components.build_lr_scheduler(self.settings.lr_schedule, self.optimizer, self.max_steps)

    def build_grad_scaler(self) -> torch.amp.GradScaler:
        """Return the gradient scaler; by default enabled for fp16 mixed precision only."""
        return torch.amp.GradScaler(self.device.type, enabled=self.settings.mixed_precision == "fp16")

    def build_hooks(self) -> list[BaseHook]:
        """Return the hooks built in code; the run calls them, then those ``settings.hooks`` declares.

        By default none. An override need not (and should not) build the declared hooks.
        """
        return []

    def forward(self, input: Any) -> tuple[torch.Tensor | None, Records]:
        """Compute the loss of one microstep's batch.

        Args:
            input: A batch drawn from the data loader.

        Returns:
            The scalar loss (``None`` skips this batch: no backward, and the next batch is drawn;
            under DDP/FSDP the wrapped model must then not have been called) and a nested dict
            of numbers for the hooks to aggregate and log.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement forward()")

    def build_predict_data_loader(self) -> Iterable[Any]:
        """Return the data ``predict()`` runs ``predict_step`` over (see docs/predict.md).

        Under several ranks, a ``DataLoader`` with a ``DistributedSampler``. No implicit fallback:
        to predict the validation data, return its loader here.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement build_predict_data_loader() to predict")

    def predict_step(self, batch: Any) -> torch.Tensor | dict[str, torch.Tensor]:
        """Compute the outputs of one batch of the predict data (eval mode, no grad, ``self.autocast()``).

        Args:
            batch: A batch drawn from ``build_predict_data_loader()``'s data.

        Returns:
            A tensor, or a dict of str to tensors, whose first dimension is the batch's items
            (saved under ``"predictions"`` for a tensor, under its keys for a dict).
        """
        raise NotImplementedError(f"{type(self).__name__} must implement predict_step() to predict")

    @classmethod
    def missing_methods(cls, kind: str = "train") -> list[str]:
        """The methods of the user's contract this class leaves to the stubs below.

        ``build_optimizer`` is listed when not overridden, though ``settings.optimizer`` can
        stand in for it (the preflight decides).

        Args:
            kind: The run whose methods to list (``"train"``; a ``"predict"`` run needs ``build_model``,
                ``build_predict_data_loader`` and ``predict_step`` only).
        """
        required: tuple[str, ...] = ("build_data_loader", "build_model", "forward", "build_optimizer")
        if kind == "predict":
            required = ("build_model", "build_predict_data_loader", "predict_step")
        return [name for name in required if getattr(cls, name) is getattr(Contract, name)]
