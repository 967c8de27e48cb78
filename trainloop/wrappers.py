"""Seeing through model wrappers (``torch.compile``, DDP, FSDP, ``AveragedModel``) and keeping train/eval modes."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch
from torch import nn

__all__ = ["is_distributed_model", "module_modes_kept", "unwrap_model"]


def unwrap_model(module: nn.Module) -> nn.Module:
    """See through ``torch.compile``, DDP, DataParallel and ``AveragedModel`` wrappers."""
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
