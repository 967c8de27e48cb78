"""A DeepSpeed engine in a checkpoint: every rank's partitions in ``deepspeed/`` beside trainloop's state, one manifest.

The engine owns the model's, the optimizer's and the lr scheduler's state (partitioned under ZeRO), so a checkpoint
of a run under ``settings.deepspeed`` holds the engine's own layout, written by ``engine.save_checkpoint`` on every
rank (its files under the tag ``engine``, DeepSpeed's recovery scripts beside it, no DeepSpeed ``latest``: trainloop's
names the checkpoint), and trainloop's training state (step, data position, RNG, hooks) in the rest file. Each rank
hashes the files it wrote for the manifest, and a resume verifies them by shares before the engine reads them: a
damaged partition, which DeepSpeed itself would load, is a corrupt checkpoint (an older one is taken).

The layout of the engine's files depends on its ZeRO stage, its precision and its number of ranks: ``metadata.json``
records the first two (``engine_layout``; the partitions' names say the ranks), and a resume whose engine differs is
refused in one line per difference before the engine reads anything (DeepSpeed would fail deep inside, or load
another precision's weights silently). A checkpoint written before the layout was recorded loads as it did.

Nothing here imports DeepSpeed: a run that has an engine has imported it.
"""

from __future__ import annotations

import contextlib
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from trainloop.checkpoint.errors import CheckpointError, CheckpointMismatchError
from trainloop.checkpoint.loading import VerifiedFiles, load_file
from trainloop.checkpoint.manifest import REST_FILE, FileDigest, hash_file, read_metadata
from trainloop.distributed.ranks import rank, world_size

if TYPE_CHECKING:
    from torch import nn

    from trainloop.location import Location

__all__ = [
    "ENGINE_DIR", "LAYOUT", "TAG", "deepspeed_engine", "engine_layout", "engine_weights", "layout_problems",
    "load_engine", "read_engine_checkpoint", "save_engine",
]

#: The engine's directory in a checkpoint.
ENGINE_DIR = "deepspeed"

#: The tag the engine's files are saved under (DeepSpeed's name for one of its checkpoints).
TAG = "engine"

#: The key of ``metadata.json`` that records the engine's layout (see ``engine_layout``).
LAYOUT = "deepspeed"

#: How a resume goes on from a checkpoint whose layout this run's engine cannot read (init_from is not applied
#: under deepspeed: the engine keeps its own copies of the weights).
_FROM_ITS_WEIGHTS = (
    "or start a new run (another workspace) from its weights, read in build_model() with "
    "trainloop.checkpoint.read_weights"
)

#: DeepSpeed names a rank's partition files ``[bf16_]zero_pp_rank_<r>_...``; rank 0 writes every other file.
_RANK_FILE = re.compile(r"zero_pp_rank_(\d+)_")


def deepspeed_engine(model: nn.Module | None) -> Any | None:
    """``model`` if it is a DeepSpeed engine (the model of a run under ``settings.deepspeed``), else ``None``."""
    engine = sys.modules.get("deepspeed.runtime.engine")  # never imported: no engine exists
    return model if engine is not None and isinstance(model, engine.DeepSpeedEngine) else None


def engine_layout(engine: Any) -> dict[str, Any]:
    """What the layout of ``engine``'s checkpoint depends on, besides its ranks: its ZeRO stage and precision."""
    precision = "bf16" if engine.bfloat16_enabled() else "fp16" if engine.fp16_enabled() else "fp32"
    return {"zero_stage": int(engine.zero_optimization_stage()), "precision": precision}


def save_engine(engine: Any, checkpoint: Location) -> dict[str, FileDigest]:
    """Write ``engine``'s state into ``checkpoint/deepspeed`` (every rank its own files); the digests of this rank's.

    Raises:
        CheckpointError: ``checkpoint`` is not a local path (DeepSpeed writes local files only).
    """
    if not isinstance(checkpoint, Path):
        raise CheckpointError(f"{checkpoint}: a DeepSpeed engine's checkpoint is written to a local path only")
    directory = checkpoint / ENGINE_DIR
    engine.save_checkpoint(str(directory), tag=TAG, save_latest=False)
    this_rank = rank()
    return {
        path.relative_to(checkpoint).as_posix(): hash_file(path)
        for path in sorted(directory.rglob("*"))
        if path.is_file() and _writer(path.name) == this_rank
    }


def load_engine(engine: Any, directory: Location, state: dict[str, Any] | VerifiedFiles) -> dict[str, Any]:
    """Load the engine's state from the checkpoint in ``directory``; return trainloop's state (the rest).

    Args:
        engine: The run's engine.
        directory: The checkpoint.
        state: What verifying it gave: its files, this rank's share verified (a full checkpoint's state dict: refused).

    Raises:
        CheckpointMismatchError: The checkpoint holds no engine (it was saved without DeepSpeed), or another number of
            ranks, ZeRO stage or precision saved it: one line each.
        CheckpointError: The engine cannot load it.
    """
    if isinstance(state, dict) or not isinstance(directory, Path) or not (directory / ENGINE_DIR / TAG).is_dir():
        raise CheckpointMismatchError(
            f"{directory}: holds no DeepSpeed engine's state, so it cannot resume a run under deepspeed: resume it "
            f"without deepspeed, {_FROM_ITS_WEIGHTS}"
        )
    problems = _layout_problems(directory, engine)
    if problems:
        state.close()
        raise CheckpointMismatchError("\n".join(problems))
    try:
        loaded, _ = engine.load_checkpoint(str(directory / ENGINE_DIR), tag=TAG, load_module_strict=True)
        if loaded is None:
            raise CheckpointError(f"{directory / ENGINE_DIR}: DeepSpeed found no checkpoint to load there")
        rest: dict[str, Any] = state.load(REST_FILE)
    finally:
        state.close()
    return rest


def read_engine_checkpoint(directory: Location, listing: dict[str, FileDigest] | None) -> dict[str, Any]:
    """A DeepSpeed checkpoint read whole into this process: the model's full weights and trainloop's state (and hooks').

    Every file is checked against ``listing`` (the manifest's entries; ``None``: unverified) before DeepSpeed reads any.
    The weights are consolidated from the ranks' partitions (see ``engine_weights``), fp32 on the CPU, keyed as the
    plain module names them; the optimizer's partitions stay where they are.

    Raises:
        CheckpointError: A file is missing or corrupt, the checkpoint is not local, or DeepSpeed (needed to
            consolidate ZeRO partitions) is not installed.
    """
    if not isinstance(directory, Path):
        raise CheckpointError(f"{directory}: a DeepSpeed engine's checkpoint is read from a local path only")
    if listing is None:
        return {"model": engine_weights(directory / ENGINE_DIR), **load_file(directory / REST_FILE)}
    files = VerifiedFiles(directory, listing)
    try:
        for rel in listing:
            files.contents(rel)  # every file checked, each read once
        return {"model": engine_weights(directory / ENGINE_DIR), **files.load(REST_FILE)}
    finally:
        files.close()


def engine_weights(directory: Path) -> dict[str, torch.Tensor]:
    """The full weights of the engine's checkpoint in ``directory`` (a checkpoint's ``deepspeed/``).

    ZeRO stage 0 keeps them whole in rank 0's model file; stages 1 to 3 partition them, and DeepSpeed's
    ``zero_to_fp32`` joins the fp32 partitions of every rank (offline: no process group).

    Raises:
        CheckpointError: DeepSpeed is not installed and the weights are partitioned.
    """
    files = directory / TAG
    if not any(files.glob("*zero_pp_rank_*_optim_states.pt")):  # stage 0: the module whole
        module: dict[str, torch.Tensor] = load_file(files / "mp_rank_00_model_states.pt")["module"]
        return {key: value.float() for key, value in module.items()}
    # DeepSpeed prints as it imports and joins: to stderr, so that stdout stays the caller's (inspect --json).
    with contextlib.redirect_stdout(sys.stderr):
        try:
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        except ImportError:
            raise CheckpointError(
                f"{directory}: joining its ZeRO partitions into full weights needs DeepSpeed: "
                "pip install 'trainloop[deepspeed]'"
            ) from None
        joined: dict[str, torch.Tensor] = get_fp32_state_dict_from_zero_checkpoint(str(directory), tag=TAG)
    return {key: value.detach().cpu() for key, value in joined.items()}


def layout_problems(directory: Location, now: dict[str, Any]) -> list[str]:
    """One line for each way the DeepSpeed checkpoint in ``directory`` was laid out otherwise than ``now`` says.

    ``now`` has ``engine_layout``'s keys; a checkpoint that did not record its layout has no problem here.
    """
    problems = []
    saved = read_metadata(directory).get(LAYOUT)
    if isinstance(saved, dict):  # recorded since the layout is checked
        if saved.get("zero_stage") != now["zero_stage"]:
            problems.append(
                f"{directory}: was saved at ZeRO stage {saved.get('zero_stage')} and this run's deepspeed config "
                f"declares stage {now['zero_stage']}: resume it with zero_optimization.stage "
                f"{saved.get('zero_stage')}, {_FROM_ITS_WEIGHTS}"
            )
        if saved.get("precision") != now["precision"]:
            then = _as_declared(saved.get("precision"))
            problems.append(
                f"{directory}: was saved with mixed_precision {then} and this run declares "
                f"{_as_declared(now['precision'])}: resume it with mixed_precision {then}, {_FROM_ITS_WEIGHTS}"
            )
    return problems


def _layout_problems(directory: Path, engine: Any) -> list[str]:
    """One line for each way the checkpoint in ``directory`` was laid out by another engine than ``engine``."""
    problems = layout_problems(directory, engine_layout(engine))
    saved_by = len({_writer(p.name) for p in (directory / ENGINE_DIR / TAG).glob("*zero_pp_rank_*")})
    if saved_by and saved_by != world_size():
        problems.append(
            f"{directory}: its ZeRO partitions were saved by {saved_by} ranks and this run has {world_size()}: "
            f"resume it on {saved_by} ranks, {_FROM_ITS_WEIGHTS}"
        )
    return problems


def _as_declared(precision: Any) -> str:
    return "unset" if precision == "fp32" else repr(precision)


def _writer(name: str) -> int:
    found = _RANK_FILE.search(name)
    return int(found.group(1)) if found else 0
