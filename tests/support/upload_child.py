"""Runs whose checkpoints go to object storage: one to be killed in the middle of an upload, and gloo ranks.

Run as ``python upload_child.py URL FORMAT ASYNC PAUSE_AT`` with fsspec's configuration in the
environment (``FSSPEC_S3_ENDPOINT_URL``...). It trains :class:`TinyTrainer` for 10 steps with a
``CheckpointingHook(path=URL, interval=2)``; the checkpoint of step ``PAUSE_AT`` pauses in the
middle of its upload (after model, training state and an 8 MB hook file, while the next file
is open) and prints ``paused <step>``, waiting to be killed. :func:`ranks_worker` is one rank
of a sharded FSDP2 run saving to a URL (started with ``torch.multiprocessing``).
"""

from __future__ import annotations

import os
import sys
import time

import torch
from tiny_trainer import TinyTrainer

from trainloop import BaseHook, TrainerSettings
from trainloop.hooks.checkpointing import CheckpointingHook


class Pause:
    """Pickled into a checkpoint file, it says so and waits there to be killed (copies stay itself)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def __deepcopy__(self, memo: dict) -> Pause:
        return self  # a background save's staging copy must not pause the training thread

    def __reduce__(self):
        os.write(sys.stdout.fileno(), f"paused {self.step}\n".encode())
        time.sleep(600)
        raise RuntimeError("not killed")


class BigState(BaseHook):
    """Adds an 8 MB tensor to every checkpoint, written before the pausing hook's file."""

    def on_state_dict(self, trainer, state_dict):
        state_dict[self.name] = {"big": torch.full((2 << 20,), float(trainer.step))}

    def on_load_state_dict(self, trainer, state_dict):
        pass


class PausingState(BaseHook):
    """Its entry of the checkpoint of step ``at`` pauses while it is written."""

    def __init__(self, at: int | None) -> None:
        self.at = at

    def on_state_dict(self, trainer, state_dict):
        state_dict[self.name] = {"pause": Pause(trainer.step)} if trainer.step == self.at else {"pause": None}

    def on_load_state_dict(self, trainer, state_dict):
        pass


def hooks(url: str, format: str, async_save: bool, pause_at: int | None, storage_options=None) -> list[BaseHook]:
    """The run's hooks (the tests resume with the same ones, ``pause_at=None``)."""
    checkpointing = CheckpointingHook(
        interval=2, path=url, format=format, async_save=async_save, storage_options=storage_options
    )
    return [checkpointing, BigState(), PausingState(pause_at)]


def main() -> None:
    url, format, async_save, pause_at = sys.argv[1], sys.argv[2], sys.argv[3] == "1", int(sys.argv[4])
    TinyTrainer(TrainerSettings(max_steps=10), hooks=hooks(url, format, async_save, pause_at)).train()


if __name__ == "__main__":
    main()


def ranks_worker(rank: int, world: int, port: int, url: str, options: dict, out: str) -> None:
    """One of ``world`` gloo ranks: FSDP2 trained straight to step 8; then sharded checkpoints to ``url``
    at steps 2 and 4, resumed to step 8. Results in ``<out>/rank<rank>.pt``."""
    import torch.distributed as dist
    from checkpoint_child import StartedAt, StepDataTrainer, full_params

    from trainloop.distributed import destroy

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        straight = StepDataTrainer(max_steps=8, wrap="fsdp")
        straight.train()
        hook = CheckpointingHook(interval=2, format="sharded", path=url, storage_options=options)
        StepDataTrainer(max_steps=4, wrap="fsdp", hooks=[hook]).train()
        started = StartedAt()
        hook = CheckpointingHook(
            interval=100, keep_previous=1, format="sharded", path=url, storage_options=options, async_save=True
        )
        resumed = StepDataTrainer(max_steps=8, wrap="fsdp", hooks=[started, hook])
        resumed.train()
        results = {"straight": full_params(straight.model), "resumed": full_params(resumed.model), "started": started.step}
        torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    finally:
        destroy(barrier=sys.exc_info()[0] is None)
