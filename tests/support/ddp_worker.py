"""Worker processes for the multi-process tests (spawned, so importable by module name)."""

from __future__ import annotations

import os
import socket
import sys
import warnings

import torch
import torch.distributed as dist
from tiny_trainer import TinyTrainer, make_data
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from trainloop.distributed import destroy


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init(rank: int, world_size: int, port: int) -> None:
    """Join a gloo process group on 127.0.0.1."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


class CountingDDP(nn.parallel.DistributedDataParallel):
    """DDP that counts how often gradient synchronisation was suspended."""

    no_sync_entries = 0

    def no_sync(self):
        CountingDDP.no_sync_entries += 1
        return super().no_sync()


class DDPTrainer(TinyTrainer):
    """TinyTrainer with each rank drawing its shard through a DistributedSampler."""

    def build_data_loader(self):
        return DataLoader(make_data(64), batch_size=4, sampler=DistributedSampler(make_data(64), shuffle=False))

    def build_model(self):
        return CountingDDP(super().build_model())


def ddp_accumulation(rank: int, world_size: int, port: int, out: str, accumulation: int) -> None:
    """Train with DDP and accumulation; save this rank's parameters and counters to ``out``."""
    init(rank, world_size, port)
    try:
        trainer = DDPTrainer(max_steps=4, gradient_accumulation_steps=accumulation)
        trainer.train()
        torch.save(
            {
                "params": [p.detach() for p in trainer.unwrapped_model.parameters()],
                "no_sync_entries": CountingDDP.no_sync_entries,
                "epoch": trainer.epoch,
            },
            os.path.join(out, f"rank{rank}.pt"),
        )
    finally:
        destroy(barrier=sys.exc_info()[0] is None)  # wait for every rank: a clean gloo exit


class SkippingDDPTrainer(DDPTrainer):
    """Returns loss=None for every other batch without calling the model."""

    def forward(self, batch):
        self.drawn = getattr(self, "drawn", 0) + 1
        if self.drawn % 2:
            return None, {}
        return super().forward(batch)


def ddp_loss_none(rank: int, world_size: int, port: int, out: str) -> None:
    """Record the warnings a loss=None raises under DDP."""
    init(rank, world_size, port)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            SkippingDDPTrainer(max_steps=2).train()
        names = sorted({type(w.message).__name__ for w in caught if "loss=None" in str(w.message)})
        torch.save(names, os.path.join(out, f"rank{rank}.pt"))
    finally:
        destroy(barrier=sys.exc_info()[0] is None)  # wait for every rank: a clean gloo exit


class ExitOnRankOne(TinyTrainer):
    """Rank 1 alone asks to exit with code 143 after step 3 (as a signal on one node would)."""

    def build_hooks(self):
        from trainloop import BaseHook

        class Request(BaseHook):
            def on_after_step(self, trainer):
                if dist.get_rank() == 1 and trainer.step == 3:
                    trainer.request_exit(143)

        return [Request()]


def exit_agreement(rank: int, world_size: int, port: int, out: str) -> None:
    """Record the step and exit code each rank ended with."""
    init(rank, world_size, port)
    try:
        trainer = ExitOnRankOne(max_steps=50)
        try:
            trainer.train()
            code = None
        except SystemExit as exit_:
            code = exit_.code
        torch.save({"step": trainer.step, "code": code, "state": trainer.state.value}, os.path.join(out, f"rank{rank}.pt"))
    finally:
        destroy(barrier=sys.exc_info()[0] is None)  # wait for every rank: a clean gloo exit


COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "broadcast", "broadcast_object_list", "barrier")


def collectives_per_step(rank: int, world_size: int, port: int, out: str, steps: int) -> None:
    """Train DDP for ``steps`` steps counting torch.distributed's collectives called on each step.

    Every collective function of ``COLLECTIVES`` is wrapped in this process (DDP's gradient
    all-reduce runs inside its C++ reducer and is not counted); each call is booked on the step
    in progress, and the counts per step are saved.
    """
    init(rank, world_size, port)
    calls: dict[int, int] = {}
    trainer = DDPTrainer(max_steps=steps)
    for name in COLLECTIVES:
        real = getattr(dist, name)

        def counted(*args, _real=real, **kwargs):  # _real bound now: not the loop's last value
            calls[trainer.step] = calls.get(trainer.step, 0) + 1
            return _real(*args, **kwargs)

        setattr(dist, name, counted)

    try:
        trainer.train()
        torch.save({"calls": calls, "step": trainer.step}, os.path.join(out, f"rank{rank}.pt"))
    finally:
        destroy(barrier=sys.exc_info()[0] is None)  # wait for every rank: a clean gloo exit


def ddp_token_loss(rank: int, world_size: int, port: int, out: str) -> None:
    """Loss(sum, count) under DDP: each rank's microsteps hold different numbers of tokens."""
    from token_data import TokenTrainer, sequences

    class DDPTokenTrainer(TokenTrainer):
        def build_model(self):
            return nn.parallel.DistributedDataParallel(super().build_model())

    init(rank, world_size, port)
    try:
        seqs = sequences()[2 * rank : 2 * rank + 2]  # rank 0: 1 + 7 tokens, rank 1: 3 + 8
        trainer = DDPTokenTrainer(max_steps=1, gradient_accumulation_steps=2, data=seqs)
        trainer.train()
        torch.save([p.detach() for p in trainer.unwrapped_model.parameters()], os.path.join(out, f"rank{rank}.pt"))
    finally:
        destroy(barrier=sys.exc_info()[0] is None)  # wait for every rank: a clean gloo exit


def agreements_closed(rank: int, world_size: int, port: int, out: str, rounds: int) -> None:
    """Close ``rounds`` exit agreements, with a reduction in flight and without; then the end of a
    run as issue 29 met it (DDP, 16 steps of 2 microsteps, a throughput-counting ``LoggingHook``
    every 4 steps, whose last agreement starts at the last step). Record, after each close and
    after the run, whether anything was still in flight; the run ends with a bare
    ``destroy_process_group()`` (its DDP module keeps the group alive until the process ends)."""
    from tiny_trainer import ItemsTrainer

    from trainloop.distributed.agreement import ExitAgreement
    from trainloop.hooks.logging_hook import LoggingHook

    class DDPItemsTrainer(ItemsTrainer):
        def build_data_loader(self):
            return DataLoader(make_data(64), batch_size=4, sampler=DistributedSampler(make_data(64), shuffle=False))

        def build_model(self):
            return nn.parallel.DistributedDataParallel(super().build_model())

    init(rank, world_size, port)
    closed = []
    for round_ in range(rounds):
        # interval 0: an agreement starts at every step, one is in flight at close; 10 s: they
        # start at steps 1 and 2 only, none is in flight after 3 (close reduces once more).
        agreement = ExitAgreement(interval=0.0 if round_ % 2 else 10.0)
        for _ in range(3):
            agreement.settle(0)
        pending = agreement._pending is not None
        agreement.close()
        closed.append((pending, agreement.in_flight))
    trainer = DDPItemsTrainer(max_steps=16, gradient_accumulation_steps=2, hooks=[LoggingHook(interval=4)])
    trainer.train()
    result = {"closed": closed, "run_in_flight": trainer.loop.requests.in_flight, "step": trainer.step}
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()
