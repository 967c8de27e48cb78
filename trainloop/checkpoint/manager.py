"""``CheckpointManager``: one run's checkpoints under one root, saved, published, pruned and loaded.

The layout: ``<root>/<step>/`` is one checkpoint and ``<root>/latest`` a relative symlink to the
newest (on object storage, which has no symlinks, an object holding the newest one's step). Each
checkpoint holds ``metadata.json`` and, written last, ``manifest.json``
(:mod:`trainloop.checkpoint.manifest`). Besides them, by format:

- ``full``: rank 0 writes one ``torch.save`` file per top-level key of ``trainer.state_dict()``:
  ``model.pt``, ``training_state.pt``, and one file per hook with state, named after its key.
- ``sharded``: every rank writes its shard of ``sharded/``, a ``torch.distributed.checkpoint``
  directory (model, optimizer and hooks' states), and rank 0 ``training_state.pt``, the rest of
  the training state (:mod:`trainloop.checkpoint.sharded`).
- ``deepspeed``: every rank writes its files of a DeepSpeed engine's own checkpoint into
  ``deepspeed/``, and rank 0 ``training_state.pt`` (:mod:`trainloop.checkpoint.deepspeed`).

The formats every rank writes take one path: each rank writes its files into the step's
directory and reports their digests, then rank 0 publishes.

Publication (:meth:`CheckpointManager._publish`) reads top to bottom: the files are written into a
hidden directory, then ``metadata.json``, the manifest, the rename into place, ``latest``, pruning
and ``best.json``. A crash at any moment leaves the previous checkpoint or the new complete one,
never a half-written directory under a step name; if ``latest`` cannot be pointed, the directory
is taken back out of its name (and one it replaced is put back). On object storage the files are
uploaded in place and the manifest, uploaded last, is what makes the checkpoint count.

Under a process group the ranks agree on every outcome: a save that failed on one rank fails on
all of them, so no rank waits in a collective for one that gave up. In the background
(``async_save``) the loop is blocked only while the state is copied to CPU memory; the files are
written on a thread (DCP's ``async_save`` for the sharded format). One save is in flight at
most: the next one, a load, or the end of the run first waits for it (:meth:`settle`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from logging import Logger
from typing import TYPE_CHECKING, Any, Literal, Protocol, cast

import torch
import torch.distributed as dist

from trainloop.checkpoint import storage
from trainloop.checkpoint.best import BestCheckpoints
from trainloop.checkpoint.errors import CheckpointError, CheckpointSaveError
from trainloop.checkpoint.manifest import (
    METADATA,
    FileDigest,
    make_metadata,
    save_torch,
    verify_checkpoint,
    write_json,
    write_manifest,
)
from trainloop.checkpoint.storage import LATEST, MANIFEST, is_step_name
from trainloop.distributed.ranks import agree_on_error, broadcast_from_rank_zero, in_process_group, rank
from trainloop.location import Location, UrlPath, location

if TYPE_CHECKING:
    from trainloop.checkpoint.loading import VerifiedFiles
    from trainloop.checkpoint.staging import CpuStage

__all__ = [
    "CheckpointManager",
    "as_save_failure",
    "check_keys",
    "checkpoint_candidates",
    "checkpoint_steps",
    "latest_checkpoint",
    "latest_step",
    "save_error",
    "sharded_state_dict",
    "write_checkpoint",
]

_FILE_KEY = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")


class Stateful(Protocol):
    """What a checkpoint is loaded into: a trainer (``TrainerView``), its state dict and its options."""

    state_dict_options: Any

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class CheckpointManager:
    """One run's checkpoints under ``root``: save, publish, prune, keep the best, point ``latest``, load.

    Args:
        root: The checkpoints directory, local or on object storage.
        format: ``"full"`` (rank 0 writes ``torch.save`` files), ``"sharded"`` (every rank
            writes its shard through ``torch.distributed.checkpoint``) or ``"deepspeed"`` (every
            rank writes its partitions through ``engine``).
        async_save: Write in the background (see the module docstring).
        logger: Where saves, loads and pruning are reported.
        keep_previous: Besides the newest checkpoint, keep this many earlier ones; ``None``:
            never prune.
        keep_interval: Never prune every ``keep_interval``-th step (0: none).
        keep_steps: Never prune these steps.
        best: Ranks the checkpoints by a metric and keeps the best from pruning (its scores
            read from ``root/best.json``, written back after each pruning); ``None``: none.
        engine: The run's DeepSpeed engine, which saves and loads the ``"deepspeed"`` format.

    Raises:
        ValueError: The ``"deepspeed"`` format without an engine, or in the background (``async_save``).
    """

    def __init__(
        self,
        root: Location,
        format: Literal["full", "sharded", "deepspeed"] = "full",
        async_save: bool = False,
        logger: Logger | None = None,
        keep_previous: int | None = None,
        keep_interval: int = 0,
        keep_steps: frozenset[int] = frozenset(),
        best: BestCheckpoints | None = None,
        engine: Any = None,
    ) -> None:
        if format == "deepspeed" and engine is None:
            raise ValueError("the deepspeed format saves a DeepSpeed engine: pass it (engine=)")
        if format == "deepspeed" and async_save:
            raise ValueError("CheckpointingHook async_save: a DeepSpeed engine's checkpoint is saved in the foreground")
        self.root = root
        self.format = format
        self.async_save = async_save
        self.logger = logger or logging.getLogger("trainloop")
        self.keep_previous = keep_previous
        self.keep_interval = keep_interval
        self.keep_steps = keep_steps
        self.best = best
        self.engine = engine
        if best is not None:
            best.load(root, _steps(root))
        self.metrics: dict[str, Any] = {}
        """The last value of every logged metric (see :meth:`log`), for the next ``metadata.json``."""
        self.last_saved: int | None = None
        self._pending: _Background | None = None
        self._group: Any = None  # the background's own process group (sharded, async)
        self._stage_: CpuStage | None = None
        self._before_step: Any = None  # the optimizer's pre-step hook waiting for a deferred copy
        self.waited = 0.0
        """Seconds optimizer steps spent waiting for background copies (see :meth:`save`)."""

    @property
    def _stage(self) -> CpuStage:
        """The CPU copy a background save writes from (made on first use: staging imports DCP)."""
        if self._stage_ is None:
            from trainloop.checkpoint.staging import CpuStage

            self._stage_ = CpuStage()
        return self._stage_

    # -- what the run logs --------------------------------------------------------------------

    def log(self, step: int, flat: Mapping[str, Any]) -> BaseException | None:
        """Remember logged metrics (flattened) for the next ``metadata.json``, and score the checkpoints.

        A monitored metric logged at the step just saved (an evaluation at the end of the run)
        scores that checkpoint now: the saved weights are the ones evaluated. Then, on rank 0,
        the checkpoints are pruned again.

        Returns:
            The error of a background save that had to complete first (see :meth:`settle`).
        """
        # Kept as given: converting a tensor to a float is a host sync, done only at a save.
        self.metrics.update(flat)
        if self.best is None:
            return None
        value = self.best.observe(step, flat)
        if value is None or self.last_saved != step:
            return None
        error = self.settle(agree=False)  # a background write settles first (no collective)
        self.best.score(step, value)
        if rank() == 0:
            self._prune(step)
        return error

    # -- saving -------------------------------------------------------------------------------

    def settle(self, agree: bool) -> BaseException | None:
        """Wait for the save in flight, if any, and return its error.

        Args:
            agree: Make the answer the same on every rank (a collective: every rank must call).
        """
        pending, self._pending = self._pending, None
        error = pending.wait() if pending is not None else None
        self._remove_wait()  # the copy is done: nothing left to wait for
        return agree_on_error(error) if agree else error

    def close(self) -> BaseException | None:
        """End the run's saving: wait for a save in flight, release what it held; returns its error.

        No agreement across ranks here: the end of a run may follow an error on one rank only.
        Pruned checkpoints are gone once it returns.
        """
        error = self.settle(agree=False)
        if self._group is not None and in_process_group():
            dist.destroy_process_group(self._group)
        self._group = None
        storage.wait_for_removals()
        return error

    def save(
        self, step: int, state_dict: dict[str, Any], optimizers: Sequence[torch.optim.Optimizer] = ()
    ) -> BaseException | None:
        """Save ``state_dict`` as ``root/<step>`` (every rank calls, nothing in flight: see :meth:`settle`).

        Args:
            step: The step, which names the checkpoint.
            state_dict: The trainer's state dict, as this rank built it.
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
        training_state = state_dict["training_state"]
        metadata = make_metadata(training_state["step"], training_state["epoch"], self.format, self.metrics)
        self.last_saved = step
        if self.best is not None and self.best.observed is not None and self.best.observed[0] == step:
            self.best.score(*self.best.observed)  # before the save: pruning reads it
        if self.format == "full":
            _refuse_sharded_tensors(state_dict)
            return self._save_full(step, state_dict, metadata, optimizers)
        if self.format == "deepspeed":
            return self._save_engine(step, state_dict, metadata)
        return self._save_sharded(step, state_dict, metadata, optimizers)

    def write_full(self, step: int, state_dict: dict[str, Any], metadata: dict[str, Any]) -> Location:
        """Write and publish ``state_dict`` as the full checkpoint ``root/<step>`` from this process alone.

        Raises:
            CheckpointSaveError: The system refused a write (disk full, permission denied...):
                nothing new is left under the step's name, the previous checkpoints are untouched.
        """
        target = self.root / str(step)
        try:
            tmp = storage.make_temporary(target)
            try:
                digests = {f"{key}.pt": _named(tmp / f"{key}.pt", save_torch, v) for key, v in state_dict.items()}
            except BaseException:
                storage.discard(tmp)
                raise
            self._publish(tmp, target, digests, metadata)
        except OSError as error:
            raise save_error(target, error) from error
        return target

    def _publish(
        self, tmp: Location, target: Location, digests: dict[str, FileDigest], metadata: dict[str, Any]
    ) -> None:
        """Complete the checkpoint written into ``tmp`` and publish it as ``target``; prune; on failure leave nothing.

        ``digests``: the files written so far. Rank 0 alone publishes.
        """
        try:
            digests[METADATA] = _named(tmp / METADATA, write_json, metadata)
            write_manifest(tmp, digests)  # last: on object storage the checkpoint counts from here
            replaced = storage.publish(tmp, target)
        except BaseException:
            storage.discard(tmp)
            raise
        try:
            self._point_latest(target)
        except BaseException:
            storage.unpublish(target, replaced)  # latest is part of the publication
            raise
        storage.drop_replaced(replaced)
        self.logger.info("Saved checkpoint %s", target)
        self._prune(int(target.name))

    def _point_latest(self, checkpoint: Location) -> None:
        """Point ``root/latest`` at ``checkpoint``, atomically (on object storage: one upload)."""
        link = self.root / LATEST
        if isinstance(link, UrlPath):
            storage.write_bytes(link, f"{checkpoint.name}\n".encode())
        else:
            storage.replace_symlink(link, checkpoint.name)

    def _prune(self, newest: int) -> None:
        """Remove the checkpoints but ``newest``, the ``keep_previous`` before it, the kept and the best.

        Only step names are removed (never ``latest`` or anything else there), and nothing
        without a ``keep_previous``. Each removed one leaves its step name at once and is deleted
        on a helper thread; a failure is logged. Then ``best.json`` lists the checkpoints still there.
        """
        if self.keep_previous is not None:
            best = self.best.kept() if self.best is not None else set()
            earlier = [step for step in _steps(self.root) if step != newest]
            recent = set(earlier[-self.keep_previous:]) if self.keep_previous else set()
            for step in earlier:
                if step in recent or step in best or self._is_kept(step):
                    continue
                try:
                    storage.remove_directory(self.root / str(step), background=self.logger)
                except OSError as error:
                    self.logger.warning("Could not remove old checkpoint %s: %s", self.root / str(step), error)
        if self.best is not None:
            self.best.write(self.root, _steps(self.root))  # after pruning: what is still there

    def _is_kept(self, step: int) -> bool:
        return (self.keep_interval > 0 and step % self.keep_interval == 0) or step in self.keep_steps

    # -- full: rank 0 writes torch.save files --------------------------------------------------

    def _save_full(self, step: int, state_dict: dict[str, Any], metadata: dict[str, Any],
                   optimizers: Sequence[torch.optim.Optimizer]) -> BaseException | None:
        if self.async_save:
            if rank() == 0:
                storage.clean_leftovers(self.root, self.logger)
                defer, copied = self._defer_until_step(optimizers)
                staged = self._stage.copy(state_dict, defer=defer)

                def work() -> None:
                    try:
                        try:
                            self._stage.finish_copy()
                        finally:
                            copied.set()
                        self.write_full(step, staged, metadata)
                    finally:
                        self._stage.release()  # no copy of the state is kept between saves

                self._pending = _Background(work, self.root / str(step))
            return None
        error = None
        if rank() == 0:
            try:
                storage.clean_leftovers(self.root, self.logger)
                self.write_full(step, state_dict, metadata)
            except _write_errors() as failure:
                error = as_save_failure(self.root / str(step), failure)
        return agree_on_error(error)

    def _defer_until_step(
        self, optimizers: Sequence[torch.optim.Optimizer]
    ) -> tuple[Callable[[torch.Tensor], bool] | None, threading.Event]:
        """Which tensors' copy can wait until the next optimizer step, and the event that step waits for.

        The first optimizer's step comes before any other's, so it waits for them all. Set the event once they are
        copied (also if the copy fails); without an optimizer nothing is deferred.
        """
        from trainloop.checkpoint.staging import stepped_by

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

    # -- sharded: every rank writes its files, rank 0 the rest ---------------------------------

    def _save_sharded(self, step: int, state_dict: dict[str, Any], metadata: dict[str, Any],
                      optimizers: Sequence[torch.optim.Optimizer]) -> BaseException | None:
        from concurrent.futures import Future

        from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
        from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

        from trainloop.checkpoint.sharded import (
            SHARDED_DIR,
            own_shards,
            quiet_single_process,
            shard_writer,
            split_state,
            visible,
        )
        from trainloop.checkpoint.staging import ReusingStager, stage_to_cpu

        target = self.root / str(step)
        prepared = self._prepare_on_rank_zero(target)
        if isinstance(prepared, BaseException):
            return prepared
        tmp: Location = prepared
        # Rank 0 made it before telling: a rank that cannot see it has other storage (node-local
        # disk, another working directory for a relative path), where its files would be lost.
        seen = rank() == 0 or visible(tmp)
        shards, rest = split_state(state_dict)
        writer = shard_writer(tmp / SHARDED_DIR)
        if not self.async_save:
            def write_shards() -> dict[str, FileDigest]:
                with quiet_single_process():
                    dcp_save(shards, storage_writer=writer, no_dist=not in_process_group())
                return own_shards(writer)

            return agree_on_error(self._finish_on_every_rank(tmp, target, seen, write_shards, rest, metadata, None))
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

        def write_in_background() -> dict[str, FileDigest]:
            upload.result()
            return own_shards(writer)

        def finish() -> None:
            try:
                error = self._finish_on_every_rank(
                    tmp, target, seen, write_in_background, staged_rest, metadata, group
                )
            finally:
                self._stage.release()  # no copy of the state is kept between saves
            if error is not None:
                raise error

        self._pending = _Background(finish, target)
        return None

    # -- deepspeed: every rank writes its partitions, rank 0 the rest --------------------------

    def _save_engine(self, step: int, state_dict: dict[str, Any], metadata: dict[str, Any]) -> BaseException | None:
        from trainloop.checkpoint.deepspeed import LAYOUT, engine_layout, save_engine
        from trainloop.checkpoint.sharded import visible

        metadata = {**metadata, LAYOUT: engine_layout(self.engine)}  # what a resume's engine must match
        target = self.root / str(step)
        prepared = self._prepare_on_rank_zero(target)
        if isinstance(prepared, BaseException):
            return prepared
        tmp: Location = prepared
        seen = rank() == 0 or visible(tmp)  # as for the sharded format
        write = functools.partial(save_engine, self.engine, tmp)
        return agree_on_error(self._finish_on_every_rank(tmp, target, seen, write, state_dict, metadata, None))

    def _prepare_on_rank_zero(self, target: Location) -> Location | BaseException:
        """Rank 0's hidden directory for ``target``, made after cleaning up, on every rank (or its failure)."""
        prepared: Location | BaseException | None = None
        if rank() == 0:
            try:
                storage.clean_leftovers(self.root, self.logger)
                prepared = storage.make_temporary(target)
            except OSError as failure:
                prepared = as_save_failure(target, failure)
        return cast(Location | BaseException, broadcast_from_rank_zero(prepared))  # every rank writes there

    def _finish_on_every_rank(self, tmp: Location, target: Location, seen: bool,
                              write: Callable[[], dict[str, FileDigest]], rest: dict[str, Any],
                              metadata: dict[str, Any], group: Any) -> BaseException | None:
        """Write this rank's files into ``tmp`` (``write`` returns their digests); rank 0 then publishes.

        Rank 0 gathers every rank's digests, checks that it sees every rank's files, writes
        ``rest`` (``training_state.pt``) and publishes. Every rank calls (``seen``: this rank
        found rank 0's ``tmp``); the others return their own error, and rank 0's verdict comes
        at the next agreement.
        """
        from trainloop.checkpoint.sharded import REST_FILE, unshared_storage

        local: tuple[dict[str, FileDigest], BaseException | None, bool]
        try:
            local = (write(), None, seen)
        except _write_errors() as failure:
            local = ({}, as_save_failure(target, failure), seen)
        if not seen:
            storage.discard(tmp)  # DCP made a directory of that name on this rank's own storage
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
            self._publish(tmp, target, digests, metadata)
        except _write_errors() as failure:
            storage.discard(tmp)
            return as_save_failure(target, failure)
        return None

    # -- loading ------------------------------------------------------------------------------

    def load(self, trainer: Stateful, load: Location | Literal["latest"]) -> Location | None:
        """Load the checkpoint ``load`` names (a directory, or ``"latest"``: the newest intact one) into ``trainer``.

        Returns:
            The checkpoint directory loaded, or ``None`` when ``"latest"`` found none.
        """
        chosen = self.choose(load)
        if chosen is None:
            return None
        directory, state = chosen
        self.logger.debug("Loading checkpoint %s", directory)
        if self.engine is not None:  # the engine reads its partitions, this rank's share verified already
            from trainloop.checkpoint.deepspeed import load_engine

            trainer.load_state_dict(load_engine(self.engine, directory, state))
            return directory
        if isinstance(state, dict):  # a full checkpoint, read and verified by choose
            trainer.load_state_dict(state)
            return directory
        from trainloop.checkpoint.sharded import load_sharded

        try:  # DCP reads through the files: this rank's share verified already, the rest as read
            with sharded_state_dict(trainer):
                trainer.load_state_dict(load_sharded(directory, trainer.state_dict(), state))
        finally:
            state.close()
        return directory

    def choose(
        self, load: Location | Literal["latest"]
    ) -> tuple[Location, dict[str, Any] | VerifiedFiles] | None:
        """The checkpoint to load: its state dict if full, its files (this rank's share verified) if sharded.

        Rank 0 lists the candidates (``load``, or for ``"latest"`` the one ``latest`` points at,
        then the others from the highest step down), every rank verifies their files as it reads
        them (a sharded one: its share; see :mod:`trainloop.checkpoint.verify`); a corrupt one
        is skipped with a warning; the same answer on every rank.
        """
        from trainloop.checkpoint.verify import open_checkpoint

        candidates: list[Location] | None = None
        error: BaseException | None = None
        if rank() == 0:
            try:
                if load != "latest":
                    if not storage.is_dir(load):
                        raise FileNotFoundError(
                            f"CheckpointingHook load={str(load)!r}: no checkpoint directory at {load}"
                        )
                    candidates = [load]
                else:
                    storage.clean_leftovers(self.root, self.logger)
                    candidates = checkpoint_candidates(self.root, self.logger)
            except OSError as failure:
                error = failure
        error = broadcast_from_rank_zero(error)
        if error is not None:
            raise error
        return open_checkpoint(candidates, explicit=load != "latest", log=self.logger)

    @property
    def best_checkpoint(self) -> Location | None:
        """The best checkpoint by the monitored metric still there, or ``None`` (none scored yet)."""
        if self.best is None:
            return None
        best = self.best.best
        return self.root / str(best) if best is not None and storage.is_dir(self.root / str(best)) else None


# -- the layout of a checkpoints root -----------------------------------------------------------


def checkpoint_steps(root: Location | str) -> list[int]:
    """The steps of the checkpoints under ``root``, ascending.

    Only a complete save gives a directory its step's name (one being written is hidden; on
    object storage, a directory without its manifest is not counted);
    whether its files are still intact, :func:`~trainloop.checkpoint.verify_checkpoint` tells.
    """
    return _steps(location(root))


def _steps(root: Location) -> list[int]:
    if isinstance(root, UrlPath):
        return sorted(
            int(rel.split("/", 1)[0]) for rel in storage.files(root)
            if rel.count("/") == 1 and rel.endswith(f"/{MANIFEST}") and is_step_name(rel.split("/", 1)[0])
        )
    if not root.is_dir():
        return []
    return sorted(int(p.name) for p in root.iterdir() if is_step_name(p.name) and p.is_dir())


def latest_step(root: Location | str) -> int | None:
    """The step ``root/latest`` names, if it names a checkpoint under ``root`` (unverified)."""
    root = location(root)
    if isinstance(root, UrlPath):
        named = _named_latest(root)
        return named if named is not None and named in _steps(root) else None
    link = root / LATEST
    if not link.is_dir():
        return None
    target = link.resolve()
    return int(target.name) if target.parent == root.resolve() and is_step_name(target.name) else None


def _named_latest(root: UrlPath) -> int | None:
    """The step the ``latest`` object under ``root`` holds, if it holds one."""
    try:
        named = storage.read_bytes(root / LATEST).decode("utf-8", "replace").strip()
    except FileNotFoundError:
        return None
    return int(named) if is_step_name(named) else None


def latest_checkpoint(
    root: Location | str, verify: bool = True, logger: Logger | None = None
) -> Location | None:
    """The newest complete checkpoint under ``root``, or ``None``.

    The one ``root/latest`` points to comes first, then the others from the highest step down.
    With ``verify``, each is checked against its manifest; one that fails is skipped with a
    warning naming it and what is wrong, and the next is tried.

    Args:
        root: The checkpoints directory.
        verify: Check the files against the manifest (hashing them); without it, the first
            candidate is returned unchecked.
        logger: Where the warnings go; ``logging.getLogger("trainloop")`` if omitted.
    """
    candidates = checkpoint_candidates(location(root), logger)
    if not verify:
        return candidates[0] if candidates else None
    for candidate in candidates:
        try:
            verify_checkpoint(candidate)
        except CheckpointError as error:
            (logger or logging.getLogger("trainloop")).warning(
                "Skipping checkpoint %s, which is incomplete or corrupt: %s", candidate, error
            )
            continue
        return candidate
    return None


def checkpoint_candidates(root: Location, logger: Logger | None = None) -> list[Location]:
    """The checkpoints under ``root`` to try resuming from, best first, unverified.

    The one ``root/latest`` points to, then the others from the highest step down.

    A ``latest`` that resolves outside ``root`` (a link into another run's checkpoints) is
    skipped with a warning: following it would resume another run's weights and step, and
    pruning would then measure this run's checkpoints against that step.
    """
    if isinstance(root, UrlPath):
        steps = _steps(root)
        named = _named_latest(root)
        first = [named] if named in steps else []
        return [root / str(step) for step in first + [s for s in reversed(steps) if s != named]]
    candidates: list[Location] = []
    link = root / LATEST
    if link.is_dir():
        target = link.resolve()
        if target.parent == root.resolve():
            candidates.append(target)
        else:
            (logger or logging.getLogger("trainloop")).warning(
                "Ignoring %s: it points to %s, outside this run's checkpoints %s; resuming from "
                "this run's own newest checkpoint instead", link, target, root,
            )
    for step in reversed(_steps(root)):
        path = root / str(step)
        if not candidates or path.resolve() != candidates[0]:
            candidates.append(path)
    return candidates


# -- one checkpoint, outside a run ----------------------------------------------------------------


def write_checkpoint(
    root: Location | str, step: int, state_dict: dict[str, Any], metadata: dict[str, Any] | None = None
) -> Location:
    """Write ``state_dict`` atomically as a full checkpoint ``root/<step>/`` and point ``root/latest`` at it.

    The files (one ``<key>.pt`` per top-level key, ``metadata.json``, then ``manifest.json``)
    are written into a hidden directory, hashed as they are written, fsynced, and renamed into
    place; then ``latest`` is replaced (see the module docstring). An existing ``root/<step>``
    is replaced the same way. Nothing is pruned.

    Args:
        root: The checkpoints directory (created if needed), or a URL.
        step: The step, which names the directory.
        state_dict: A trainer's ``state_dict()``; each top-level key becomes one file.
        metadata: The contents of ``metadata.json``; by default made from the state's step and
            epoch (see :func:`~trainloop.checkpoint.manifest.make_metadata`).

    Returns:
        The checkpoint directory.

    Raises:
        ValueError: A top-level key cannot name a file.
        CheckpointSaveError: Writing the files or updating ``latest`` failed (disk full,
            permission denied...); nothing new is left under the step's name and the previous
            checkpoints are untouched.
    """
    check_keys(state_dict)
    if metadata is None:
        training_state = state_dict.get("training_state") or {}
        metadata = make_metadata(step, training_state.get("epoch", 0), "full")
    return CheckpointManager(location(root)).write_full(step, state_dict, metadata)


def check_keys(state_dict: dict[str, Any]) -> None:
    """Check that every top-level key of a trainer state dict can name a file.

    Raises:
        ValueError: A key cannot (the message names it).
    """
    for key in state_dict:
        if not _FILE_KEY.fullmatch(key):
            raise ValueError(
                f"state_dict key {key!r} cannot name a checkpoint file; use letters, digits, '_', '-', '.'"
            )


@contextmanager
def sharded_state_dict(trainer: Stateful) -> Iterator[None]:
    """Make ``trainer.state_dict()`` and ``load_state_dict()`` keep each rank's shards.

    The trainer's own options may ask for full tensors (for full checkpoints); DCP needs the
    sharded form, so the other options are kept and these two switched off for the moment.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    saved = trainer.state_dict_options
    trainer.state_dict_options = dataclasses.replace(
        saved or StateDictOptions(), full_state_dict=False, cpu_offload=False, broadcast_from_rank0=False
    )
    try:
        yield
    finally:
        trainer.state_dict_options = saved


# -- failures -----------------------------------------------------------------------------------


def save_error(target: Location, error: BaseException) -> CheckpointSaveError:
    """The error to raise when writing the checkpoint ``target`` failed with ``error``."""
    return CheckpointSaveError(f"could not save checkpoint {target}: {error}")


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


def _write_errors() -> tuple[type[BaseException], ...]:
    """What a failed write may raise (DCP's own exception is a BaseException)."""
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


def _os_error(error: BaseException) -> OSError | None:
    """The operating system's error behind ``error``, if one is."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(error, CheckpointException) and error.failures:
        error = next(iter(error.failures.values()))[0]  # DCP collects every rank's; one says enough
    # torch's file writer reports a failed write as a RuntimeError about positions; the OS
    # error it met is in the chain.
    cause: BaseException | None = error
    while cause is not None and not isinstance(cause, OSError):
        cause = cause.__cause__ or cause.__context__
    return cause


def _named(path: Location, write: Any, value: Any) -> FileDigest:
    """``write(value, path)``; an OS error that does not name its file is given ``path``."""
    try:
        digest: FileDigest = write(value, path)
        return digest
    except OSError as error:
        if error.filename is None:
            raise OSError(error.errno, error.strerror or str(error), str(path)) from error
        raise


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
