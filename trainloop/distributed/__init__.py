"""Opt-in ``torch.distributed`` helpers for the user's own set-up (the trainer wraps nothing).

A script launched by ``torchrun`` joins the process group, wraps its model and trains::

    with init_distributed() as ctx:          # rank, world_size, local_rank, device
        MyTrainer(max_steps=1000, device=str(ctx.device)).train()

    class MyTrainer(BaseTrainer):
        def build_model(self):
            return wrap_model(Net().to(self.device), "fsdp", shard_modules=(Block,))

The process group (``process_group``), wrapping (``wrap``), ranks (``ranks``), gradient
synchronisation during accumulation (``sync``), the ranks' agreement on exit requests
(``agreement``) and means over a dataset's items, each counted once (``means``) each have a module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainloop.lazy import lazy_exports

if TYPE_CHECKING:  # at run time each name is imported on first use
    from trainloop.distributed.means import ItemMeans, ItemMeansError
    from trainloop.distributed.process_group import (
        DistributedContext,
        destroy,
        get_device,
        init_distributed,
        is_main,
        local_rank,
    )
    from trainloop.distributed.ranks import rank, world_size
    from trainloop.distributed.sync import gradient_sync
    from trainloop.distributed.wrap import DDPOptions, FSDPOptions, Strategy, wrap_model

# Imported on first use: a user of `ranks` or `sync` (the checkpoint hook is one) does not pay for
# wrap's import of torch.distributed.fsdp (about 0.3 s, a sympy import inside).
_EXPORTS: dict[str, str] = {
    "ItemMeans": "trainloop.distributed.means",
    "ItemMeansError": "trainloop.distributed.means",
    "DistributedContext": "trainloop.distributed.process_group",
    "destroy": "trainloop.distributed.process_group",
    "get_device": "trainloop.distributed.process_group",
    "init_distributed": "trainloop.distributed.process_group",
    "is_main": "trainloop.distributed.process_group",
    "local_rank": "trainloop.distributed.process_group",
    "rank": "trainloop.distributed.ranks",
    "world_size": "trainloop.distributed.ranks",
    "gradient_sync": "trainloop.distributed.sync",
    "DDPOptions": "trainloop.distributed.wrap",
    "FSDPOptions": "trainloop.distributed.wrap",
    "Strategy": "trainloop.distributed.wrap",
    "wrap_model": "trainloop.distributed.wrap",
}

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

__all__ = [
    "DDPOptions",
    "DistributedContext",
    "FSDPOptions",
    "ItemMeans",
    "ItemMeansError",
    "Strategy",
    "destroy",
    "get_device",
    "gradient_sync",
    "init_distributed",
    "is_main",
    "local_rank",
    "rank",
    "world_size",
    "wrap_model",
]
