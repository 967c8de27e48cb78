"""Opt-in ``torch.distributed`` helpers for the user's own set-up (the trainer wraps nothing).

A script launched by ``torchrun`` joins the process group, wraps its model and trains::

    with init_distributed() as ctx:          # rank, world_size, local_rank, device
        MyTrainer(max_steps=1000, device=str(ctx.device)).train()

    class MyTrainer(BaseTrainer):
        def build_model(self):
            return wrap_model(Net().to(self.device), "fsdp", shard_modules=(Block,))

The process group (``process_group``), wrapping (``wrap``), ranks (``ranks``), gradient
synchronisation during accumulation (``sync``) and the ranks' agreement on exit requests
(``agreement``) each have a module.
"""

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

__all__ = [
    "DDPOptions",
    "DistributedContext",
    "FSDPOptions",
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
