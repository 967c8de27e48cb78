"""Writing checkpoints from a training run: either format, in the foreground or the background.

Under a process group, the ranks agree on every outcome: a save that failed on one rank fails
on all of them, so no rank waits in a collective for one that gave up.

In the background (``async_save``), the training loop is blocked only while the state is
copied to CPU memory; the files are written on a thread (DCP's ``async_save`` for the sharded
format). One save is in flight at most: the next one, a load, or the end of the run first
waits for it. ``latest`` and pruning follow only once the write completed and its directory
was renamed into place (on object storage: once its manifest was uploaded, last).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from logging import Logger
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from trainloop.checkpoint.deepspeed import save_engine
from trainloop.checkpoint.errors import CheckpointError
from trainloop.checkpoint.files import check_keys, point_latest, save_error, write_checkpoint
from trainloop.checkpoint.manifest import METADATA, FileDigest, save_torch, write_json, write_manifest
from trainloop.checkpoint.sharded import (
    REST_FILE,
    SHARDED_DIR,
    CheckpointException,
    own_shards,
    quiet_single_process,
    shard_writer,
    split_state,
    unshared_storage,
    visible,
)
from trainloop.checkpoint.staging import CpuStage, ReusingStager, stage_to_cpu, stepped_by
from trainloop.checkpoint.storage import Location, clean_leftovers, discard, make_temporary, publish
from trainloop.distributed.ranks import in_process_group, rank

__all__ = ["CheckpointSaver", "agree_on_error", "broadcast_from_rank_zero"]

#: What a failed write may raise (DCP's own exception is a BaseException).
_WRITE_ERRORS = (Exception, CheckpointException)


def broadcast_from_rank_zero(value: Any, group: Any = None) -> Any:
    """Rank 0's ``value`` on every rank (just ``value`` without a process group)."""
    if not in_process_group():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def agree_on_error(error: BaseException | None, group: Any = None) -> BaseException | None:
    """This rank's error, else the first other rank's, else ``None``: the same on every rank."""
    if not in_process_group():
        return error
    errors: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(errors, error, group=group)
    if error is not None:
        return error  # the original, with its cause
    return next((e for e in errors if e is not None), None)


class _Background:
    """One save of ``target`` running on its own thread; :meth:`wait` returns its failure.

    Not a daemon: at interpreter exit Python waits for it, so the write is never cut short.
    """

    def __init__(self, work: Callable[[], None], target: Location) -> None:
        self.error: BaseException | None = None
        self._target = target
        self._thread = threading.Thread(target=self._run, args=(work,), name=f"checkpoint-{target.name}")
        self._thread.start()

    def _run(self, work: Callable[[], None]) -> None:
        try:
            work()
        except BaseException as error:  # noqa: BLE001 - wait() reports it on the training thread
            self.error = as_save_failure(self._target, error)

    def wait(self) -> BaseException | None:
        self._thread.join()
        return self.error


class CheckpointSaver:
    """Writes a run's checkpoints in one format, in the foreground or the background.

    Args:
        format: ``"full"`` (rank 0 writes ``torch.save`` files) or ``"sharded"`` (every rank
            writes its shard through ``torch.distributed.checkpoint``).
        async_save: Write in the background (see the module docstring).
        logger: Where successful saves are reported.
    """

    def __init__(self, format: str, async_save: bool, logger: Logger, engine: Any = None) -> None:
        self.format = format
        self.engine = engine  # a DeepSpeed engine: its partitions saved in the sharded way
        self.async_save = async_save
        self.logger = logger
        self._pending: _Background | None = None
        self._group: Any = None  # the background's own process group (sharded, async)
        self._stage = CpuStage()
        self._before_step: Any = None  # the optimizer's pre-step hook waiting for a deferred copy
        self.waited = 0.0
        """Seconds optimizer steps spent waiting for background copies (see :meth:`save`)."""

    def settle(self, agree: bool) -> BaseException | None:
        """Wait for the save in flight, if any, and return its error.

        Args:
            agree: Make the answer the same on every rank (a collective: every rank must call).
        """
        pending, self._pending = self._pending, None
        error = pending.wait() if pending is not None else None
        self._remove_wait()  # the copy is done: nothing left to wait for
        return agree_on_error(error) if agree else error

    def close(self) -> None:
        """Release the background's process group (after :meth:`settle`)."""
        if self._group is not None and in_process_group():
            dist.destroy_process_group(self._group)
        self._group = None

    def save(
        self,
        root: Location,
        step: int,
        state_dict: dict[str, Any],
        metadata: dict[str, Any],
        published: Callable[[Location], None],
        optimizers: Sequence[torch.optim.Optimizer] = (),
    ) -> BaseException | None:
        """Save ``state_dict`` as ``root/<step>`` (every rank calls, nothing in flight: see :meth:`settle`).

        Args:
            root: The checkpoints directory, local or on object storage.
            step: The step, which names the checkpoint.
            state_dict: The trainer's state dict, as this rank built it.
            metadata: The contents of ``metadata.json``.
            published: Called on rank 0 with the checkpoint once it is in place and ``latest``
                points at it (in the background when saving asynchronously).
            optimizers: The run's optimizers, in update order. A background save then copies
                their parameters and state (which only their steps change) on a background
                thread, and the first one's next step waits for that copy, instead of the loop
                waiting for the whole copy now.

        Returns:
            The error of a foreground save, agreed by all ranks (``None``: saved); a background
            save's error is returned by a later :meth:`settle`.

        Raises:
            ValueError: The state cannot be saved in this format (every rank raises).
            RuntimeError: A background save is still in flight.
        """
        if self._pending is not None:
            raise RuntimeError("a checkpoint is still being written: settle() it before the next save")
        check_keys(state_dict)
        if self.format == "full":
            _refuse_sharded_tensors(state_dict)
            return self._save_full(root, step, state_dict, metadata, published, optimizers)
        return self._save_sharded(root, step, state_dict, metadata, published, optimizers)

    # -- full: rank 0 writes torch.save files ------------------------------------------------

    def _save_full(self, root: Location, step: int, state_dict: dict[str, Any], metadata: dict[str, Any],
                   published: Callable[[Location], None],
                   optimizers: Sequence[torch.optim.Optimizer]) -> BaseException | None:
        def write(state: dict[str, Any]) -> None:
            target = write_checkpoint(root, step, state, metadata)
            self.logger.info("Saved checkpoint %s", target)
            published(target)

        if self.async_save:
            if rank() == 0:
                clean_leftovers(root, self.logger)
                defer, copied = self._defer_until_step(optimizers)
                staged = self._stage.copy(state_dict, defer=defer)

                def work() -> None:
                    try:
                        try:
                            self._stage.finish_copy()
                        finally:
                            copied.set()
                        write(staged)
                    finally:
                        self._stage.release()  # no copy of the state is kept between saves

                self._pending = _Background(work, root / str(step))
            return None
        error = None
        if rank() == 0:
            try:
                clean_leftovers(root, self.logger)
                write(state_dict)
            except _WRITE_ERRORS as failure:
                error = as_save_failure(root / str(step), failure)
        return agree_on_error(error)

    def _defer_until_step(
        self, optimizers: Sequence[torch.optim.Optimizer]
    ) -> tuple[Callable[[torch.Tensor], bool] | None, threading.Event]:
        """Which tensors' copy can wait until the next optimizer step, and the event that step waits for.

        The first optimizer's step comes before any other's, so it waits for them all. Set the event once they are
        copied (also if the copy fails); without an optimizer nothing is deferred.
        """
        copied = threading.Event()
        if not optimizers:
            return None, copied
        self._wait_before_step(optimizers[0], copied)
        return stepped_by(optimizers), copied

    def _wait_before_step(self, optimizer: torch.optim.Optimizer, copied: threading.Event) -> None:
        """Make ``optimizer``'s next step wait until ``copied`` (then the hook removes itself)."""
        def wait(*_: Any) -> None:
            started = time.perf_counter()
            copied.wait()
            self.waited += time.perf_counter() - started
            self._remove_wait()

        self._remove_wait()
        self._before_step = optimizer.register_step_pre_hook(wait)

    def _remove_wait(self) -> None:
        if self._before_step is not None:
            self._before_step.remove()
            self._before_step = None

    # -- sharded: every rank writes its shard, rank 0 the rest -------------------------------

    def _save_sharded(self, root: Location, step: int, state_dict: dict[str, Any], metadata: dict[str, Any],
                      published: Callable[[Location], None],
                      optimizers: Sequence[torch.optim.Optimizer]) -> BaseException | None:
        target = root / str(step)
        prepared = self._temporary(root, target)
        if isinstance(prepared, BaseException):
            return prepared
        tmp: Location = prepared
        # Rank 0 made it before telling: a rank that cannot see it has other storage (node-local
        # disk, another working directory for a relative path), where its shards would be lost.
        seen = rank() == 0 or visible(tmp)
        engine = self.engine
        if engine is not None:  # every rank writes its partitions (trainloop.checkpoint.deepspeed)
            return agree_on_error(
                self._finish_sharded(tmp, target, seen, lambda: save_engine(engine, tmp), state_dict, metadata,
                                     published, None)
            )
        shards, rest = split_state(state_dict)
        writer = shard_writer(tmp / SHARDED_DIR)
        if not self.async_save:
            def write_shards() -> dict[str, FileDigest]:
                with quiet_single_process():
                    dcp_save(shards, storage_writer=writer, no_dist=not in_process_group())
                return own_shards(writer)

            return agree_on_error(
                self._finish_sharded(tmp, target, seen, write_shards, rest, metadata, published, None)
            )
        if self._group is None and in_process_group():
            # The background's collectives get their own group: on the default one they could
            # interleave with the training loop's and deadlock.
            self._group = dist.new_group(backend="gloo")
        staged_rest = stage_to_cpu(rest) if rank() == 0 else rest
        # Shards on an accelerator other than CUDA are staged by DCP itself (fresh buffers each time).
        suits = ReusingStager.suits(shards)
        stager = ReusingStager(self._stage, *self._defer_until_step(optimizers)) if suits else None
        with quiet_single_process():  # here only the staging; DCP's thread may still say it
            response = dcp_async_save(shards, storage_writer=writer, process_group=self._group,
                                      async_stager=stager, no_dist=not in_process_group())
        # A response of two futures when the stager copies in the background (else the writing's future).
        upload = cast(Future[None], getattr(response, "upload_completion", response))
        group = self._group

        def written() -> dict[str, FileDigest]:
            upload.result()
            return own_shards(writer)

        def finish() -> None:
            try:
                error = self._finish_sharded(
                    tmp, target, seen, written, staged_rest, metadata, published, group
                )
            finally:
                self._stage.release()  # no copy of the state is kept between saves
            if error is not None:
                raise error

        self._pending = _Background(finish, target)
        return None

    def _temporary(self, root: Location, target: Location) -> Location | BaseException:
        """Rank 0's temporary directory of ``target``, which every rank writes into (or why it could not be made)."""
        prepared: Location | BaseException | None = None
        if rank() == 0:
            try:
                clean_leftovers(root, self.logger)
                prepared = make_temporary(target)
            except OSError as failure:
                prepared = as_save_failure(target, failure)
        made: Location | BaseException = broadcast_from_rank_zero(prepared)
        return made

    def _finish_sharded(self, tmp: Location, target: Location, seen: bool,
                        write_shards: Callable[[], dict[str, FileDigest]], rest: dict[str, Any],
                        metadata: dict[str, Any], published: Callable[[Location], None],
                        group: Any) -> BaseException | None:
        """Finish the checkpoint after every rank wrote its shards.

        Gather their digests, and rank 0 checks that it sees every rank's files, completes the checkpoint (the rest,
        metadata, manifest) and publishes it. Every rank calls; ``seen``: this rank found rank 0's ``tmp``.
        """
        local: tuple[dict[str, FileDigest], BaseException | None, bool]
        try:
            local = (write_shards(), None, seen)
        except _WRITE_ERRORS as failure:
            local = ({}, as_save_failure(target, failure), seen)
        if not seen:
            discard(tmp)  # DCP made a directory of that name on this rank's own storage
        gathered = _gather_to_rank_zero(local, group)
        if gathered is None:  # not rank 0: rank 0 decides, and tells at the next agreement
            return local[1]
        try:
            # Storage rank 0 cannot see first: a rank writing elsewhere may also have failed there.
            unshared = unshared_storage(target, tmp, [(digests, saw) for digests, _, saw in gathered])
            if unshared is not None:
                raise CheckpointError(unshared)
            reported = next((f for _, f, _ in gathered if f is not None), None)
            if reported is not None:
                raise reported  # DCP fails on every rank alike: one rank's account is enough
            digests = {rel: digest for shard_digests, _, _ in gathered for rel, digest in shard_digests.items()}
            digests[REST_FILE] = save_torch(rest, tmp / REST_FILE)
            digests[METADATA] = write_json(metadata, tmp / METADATA)
            write_manifest(tmp, digests)
            publish(tmp, target, then=lambda: point_latest(target))
        except _WRITE_ERRORS as failure:
            discard(tmp)
            return as_save_failure(target, failure)
        self.logger.info("Saved checkpoint %s", target)
        published(target)
        return None


def as_save_failure(target: Location, error: BaseException) -> CheckpointError:
    """What writing checkpoint ``target`` failing with ``error`` is reported as.

    A :class:`CheckpointSaveError` (which ``on_save_error="warn"`` turns into a warning) when
    the operating system refused a write (disk full, permission denied...), else a
    :class:`CheckpointError` (always raised): a state that cannot be written is a bug to fix.
    """
    if isinstance(error, CheckpointError):
        return error
    refused = _os_error(error)
    failure: CheckpointError
    if refused is not None:
        failure = save_error(target, refused)
    else:
        failure = CheckpointError(f"could not save checkpoint {target}: {type(error).__name__}: {error}")
    failure.__cause__ = error
    return failure


def _os_error(error: BaseException) -> OSError | None:
    """The operating system's error behind ``error``, if one is."""
    if isinstance(error, CheckpointException) and error.failures:
        error = next(iter(error.failures.values()))[0]  # DCP collects every rank's; one says enough
    # torch's file writer reports a failed write as a RuntimeError about positions; the OS
    # error it met is in the chain.
    cause: BaseException | None = error
    while cause is not None and not isinstance(cause, OSError):
        cause = cause.__cause__ or cause.__context__
    return cause


def _gather_to_rank_zero(value: Any, group: Any) -> list[Any] | None:
    if not in_process_group():
        return [value]
    gathered: list[Any] | None = [None] * dist.get_world_size(group) if rank() == 0 else None
    dist.gather_object(value, gathered, dst=0, group=group)
    return gathered


def _refuse_sharded_tensors(state_dict: dict[str, Any]) -> None:
    """The full format needs whole tensors: a DTensor here holds only this rank's shard."""
    from torch.distributed.tensor import DTensor

    def find(obj: Any, path: str) -> str | None:
        if isinstance(obj, DTensor):
            return path
        if isinstance(obj, dict):
            items: Any = obj.items()
        elif isinstance(obj, (list, tuple)):
            items = enumerate(obj)
        else:
            return None
        for key, value in items:
            found = find(value, f"{path}.{key}" if path else str(key))
            if found:
                return found
        return None

    found = find(state_dict, "")
    if found:
        raise ValueError(
            f"CheckpointingHook format='full' got a sharded tensor (DTensor) at {found!r}: rank 0 would "
            "write only its own shard. Give the trainer state_dict_options=StateDictOptions("
            "full_state_dict=True, cpu_offload=True), or use format='sharded'"
        )
