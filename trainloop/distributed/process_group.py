"""The process group: joining it under ``torchrun`` (``init_distributed``), the device, leaving it.

Run alone (no ``torchrun`` environment), ``init_distributed()`` is a no-op context, so the same
script trains in one process; the package docstring (``trainloop.distributed``) shows a script.
"""

from __future__ import annotations

import gc
import logging
import os
from dataclasses import dataclass, field
from datetime import timedelta
from types import TracebackType
from typing import Self

import torch
import torch.distributed as dist
from pydantic import ConfigDict, StrictStr, validate_call

from trainloop.distributed.ranks import is_rank_zero

__all__ = [
    "DistributedContext",
    "destroy",
    "get_device",
    "gpus_for_ranks_problem",
    "init_distributed",
    "is_main",
    "local_rank",
]

logger = logging.getLogger(__name__)

# torchrun's rendezvous variables that init_process_group("env://") reads.
_REQUIRED_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_ARBITRARY = ConfigDict(arbitrary_types_allowed=True, strict=True)


# -- the process group ---------------------------------------------------------------------------


@dataclass(frozen=True)
class DistributedContext:
    """Where this process stands: what ``init_distributed`` set up (or found).

    Use it as a context manager to destroy the process group on exit, if
    ``init_distributed`` created it (a group it found already initialised is left alone).

    Attributes:
        rank: This process's rank in the default group (0 when alone).
        world_size: The number of processes (1 when alone).
        local_rank: The rank on this machine (torchrun's ``LOCAL_RANK``; 0 when alone).
        device: The device this process should use (see ``get_device``).
        backend: The process group's backend (``"gloo"``, ``"nccl"``...), or ``None`` when no
            group is initialised.
        owns_group: Whether ``init_distributed`` created the group, so exiting the context
            destroys it.
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None = None
    owns_group: bool = field(default=False, repr=False)

    @property
    def is_distributed(self) -> bool:
        """Whether a process group is set up (even of one process)."""
        return self.backend is not None

    @property
    def is_main(self) -> bool:
        """Whether this is rank 0 (the process that writes files and prints)."""
        return self.rank == 0

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if not self.owns_group:
            return
        # A barrier only when every rank is here (a clean end, or an agreed exit such as an exit
        # signal's SystemExit): after an error on one rank the others may never arrive.
        destroy(barrier=exc_type is None or issubclass(exc_type, SystemExit))


@validate_call(config=_ARBITRARY)
def init_distributed(
    *,
    backend: StrictStr | None = None,
    device: StrictStr | torch.device | None = None,
    timeout: timedelta | None = None,
) -> DistributedContext:
    """Join the default process group described by torchrun's environment, if there is one.

    Under ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set;
    ``LOCAL_RANK`` too, else it is taken to be ``RANK``), this selects the device, makes it
    current (on an accelerator) and calls ``init_process_group`` with the device's default
    backend: ``nccl`` on CUDA, ``gloo`` on the CPU. Without that environment nothing is
    initialised and the context describes a single process. If a group is already initialised
    it is described, not initialised again.

    Args:
        backend: The backend to use instead of the device's default (any string
            ``init_process_group`` accepts, e.g. ``"cpu:gloo,cuda:nccl"``).
        device: The device to use instead of ``get_device``'s choice (e.g. ``"cpu"`` to run
            on the CPU on a machine with GPUs).
        timeout: The process group's timeout for collectives; torch's default if omitted.

    Returns:
        A ``DistributedContext``; ``with init_distributed() as ctx:`` destroys the group
        on exit.

    Raises:
        RuntimeError: The torchrun environment is incomplete or not numbers (names the variable); or
            NCCL would put two of this machine's ranks on one GPU (more ranks than GPUs, see
            ``gpus_for_ranks_problem``), before any step.
        pydantic.ValidationError: An argument has the wrong type; the error names it.
    """
    chosen = torch.device(device) if device is not None else None
    if dist.is_available() and dist.is_initialized():
        return DistributedContext(
            rank=dist.get_rank(),
            world_size=dist.get_world_size(),
            local_rank=_env_local_rank(),
            device=chosen or get_device(),
            backend=str(dist.get_backend()),
        )
    env = _torchrun_env()
    if env is None:
        return DistributedContext(rank=0, world_size=1, local_rank=0, device=chosen or get_device())
    if not dist.is_available():
        raise RuntimeError("torchrun's environment is set but this torch build has no torch.distributed")
    target = chosen or get_device(env["LOCAL_RANK"])
    accelerator = target.type != "cpu"
    backend = backend or _default_backend(target)
    if chosen is None and target.type == "cuda" and "nccl" in backend:
        # Before NCCL's own "Duplicate GPU detected", which comes only once the ranks meet.
        problem = gpus_for_ranks_problem(_env_local_world_size(), torch.cuda.device_count())
        if problem is not None:
            raise RuntimeError(problem)
    if accelerator and target.index is not None:
        torch.accelerator.set_device_index(target.index)  # collectives and kernels default to it
    logger.debug(
        "Joining the process group: rank %d of %d, local rank %d, %s, backend %s",
        env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], target, backend,
    )
    dist.init_process_group(
        backend=backend,
        timeout=timeout,
        # Binding the group to the device avoids a guessed device (and nccl's warning about it).
        device_id=target if accelerator else None,
    )
    return DistributedContext(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=env["LOCAL_RANK"],
        device=target,
        backend=str(dist.get_backend()),
        owns_group=True,
    )


def _torchrun_env() -> dict[str, int] | None:
    """The launcher's ranks (None when not launched by one); the address is read by torch."""
    if not any(name in os.environ for name in ("RANK", "WORLD_SIZE")):
        return None
    missing = [name for name in _REQUIRED_ENV if not os.environ.get(name)]
    if missing:
        raise RuntimeError(
            f"incomplete torchrun environment: {', '.join(missing)} not set (need "
            f"{', '.join(_REQUIRED_ENV)}; launch with torchrun, or unset RANK and WORLD_SIZE "
            "to run in one process)"
        )
    env = {name: _env_int(name) for name in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    env["LOCAL_RANK"] = _env_int("LOCAL_RANK") if os.environ.get("LOCAL_RANK") else env["RANK"]
    if not 0 <= env["RANK"] < env["WORLD_SIZE"]:
        raise RuntimeError(f"RANK={env['RANK']} is not in [0, WORLD_SIZE={env['WORLD_SIZE']})")
    return env


def gpus_for_ranks_problem(local_ranks: int | None, gpus: int) -> str | None:
    """Why NCCL cannot give each rank on this machine a GPU of its own, in one line; ``None`` if it can.

    NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), and says so only once the ranks
    first communicate; ``get_device`` hands GPUs out modulo their count. The count of local ranks
    is torchrun's ``LOCAL_WORLD_SIZE``; a launcher that does not set it may give every process a
    GPU of its own (``CUDA_VISIBLE_DEVICES`` per process), so nothing is checked then.

    Args:
        local_ranks: The ranks started on this machine, or ``None`` when unknown.
        gpus: The GPUs this process sees.
    """
    if local_ranks is None or local_ranks <= gpus:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    seen = f"{gpus} visible GPU{'s' if gpus != 1 else ''}" + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible else "")
    return (
        f"{local_ranks} ranks were started on this machine, which has {seen}: NCCL needs a GPU per rank; "
        f"start at most {gpus} per machine (torchrun --nproc_per_node={gpus}), or run on the CPU with "
        'init_distributed(backend="gloo", device="cpu")'
    )


def _env_local_world_size() -> int | None:
    return _env_int("LOCAL_WORLD_SIZE") if os.environ.get("LOCAL_WORLD_SIZE") else None


def _env_int(name: str) -> int:
    value = os.environ[name]
    try:
        number = int(value)
    except ValueError:
        raise RuntimeError(f"environment variable {name}={value!r} is not an integer") from None
    if number < 0:
        raise RuntimeError(f"environment variable {name}={value!r} is negative")
    return number


def _default_backend(device: torch.device) -> str:
    lookup = getattr(dist, "get_default_backend_for_device", None)  # torch >= 2.7
    if lookup is not None:
        try:
            return str(lookup(device))
        except (RuntimeError, ValueError):  # an accelerator without a registered backend
            return "gloo"
    return "nccl" if device.type == "cuda" else "gloo"


def get_device(local_rank: int | None = None) -> torch.device:
    """The device this process should use: its accelerator by local rank, else the CPU.

    Args:
        local_rank: The local rank choosing among the machine's accelerators (modulo their
            number); the ``LOCAL_RANK`` environment variable (0 if unset) when omitted.
    """
    if not torch.accelerator.is_available():
        return torch.device("cpu")
    accelerator = torch.accelerator.current_accelerator()
    assert accelerator is not None  # is_available() said there is one
    index = _env_local_rank() if local_rank is None else local_rank
    return torch.device(accelerator.type, index % torch.accelerator.device_count())


def local_rank() -> int:
    """This process's rank on its machine (torchrun's ``LOCAL_RANK``); 0 when unset."""
    return _env_local_rank()


def _env_local_rank() -> int:
    return _env_int("LOCAL_RANK") if os.environ.get("LOCAL_RANK") else 0


def is_main() -> bool:
    """Whether this is rank 0, or the only process."""
    return is_rank_zero()


def destroy(barrier: bool = False) -> None:
    """Destroy the default process group if one is initialised; otherwise do nothing.

    Destroying the group does not end a backend that something else still holds: a
    ``DistributedDataParallel`` module keeps its group alive (with gloo, its worker threads)
    until the process ends, and a worker thread that drops the last reference to a collective's
    tensors while Python is shutting down needs the GIL, which then aborts the process
    ("terminate called without an active exception"). So the ranks first wait for each other,
    every collective settled, and the objects no longer reachable (a trainer and its model,
    with their groups) are collected while the interpreter is still whole.

    Args:
        barrier: Wait for every rank first (every rank must call then).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    if barrier and dist.get_world_size() > 1:
        dist.barrier()
    dist.destroy_process_group()
    gc.collect()
