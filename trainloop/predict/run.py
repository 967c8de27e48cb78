"""The work of ``predicting``: ``predict_step`` over the predict data, gathered in dataset order, written once.

The model is in eval mode (each submodule gets its mode back afterwards), under ``torch.no_grad()``
and the trainer's autocast. Rank 0 shows a progress bar (tqdm, when installed and standard error
is a terminal) and writes the file; every rank returns the gathered outputs.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator, Sized
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from time import perf_counter
from typing import TYPE_CHECKING, Any

import torch

from trainloop.checkpoint.errors import CheckpointError
from trainloop.checkpoint.weights import Weights, init_from, load_weights, read_weights
from trainloop.distributed.gather import gather_items
from trainloop.distributed.ranks import is_rank_zero, rank, world_size
from trainloop.machine.table import State
from trainloop.predict.files import write_predictions
from trainloop.predict.order import item_order
from trainloop.predict.outputs import PredictionOutputs
from trainloop.rng import seed_all
from trainloop.wrappers import module_modes_kept

if TYPE_CHECKING:
    from trainloop.run_state import TrainerContract

__all__ = ["PredictRequest", "PredictRun", "predict_items", "restore_model"]


@dataclass(frozen=True)
class PredictRequest:
    """What ``trainer.predict()`` was asked.

    Attributes:
        checkpoint: ``None`` (the model as built, or as ``settings.init_from`` gives it),
            ``"latest"`` (the run's latest checkpoint) or a checkpoint directory, full or sharded.
        weights: ``"model"``, ``"ema"`` or an EMA hook's name: which of the checkpoint's weights.
        output: The file to write (``None``: none).
    """

    checkpoint: str | Path | None = None
    weights: str = "model"
    output: Path | None = None


class PredictRun:
    """The work of a predict run's states: ``building``, ``restoring``, ``predicting``.

    A predict run builds the predict data and the model, nothing else: no training data, no
    optimizer, no hooks (nothing is logged, saved or checkpointed), so nothing is written into
    the checkpoint directory nor into ``metrics.jsonl``.

    Args:
        trainer: The trainer.
        built: Where the built components go (the run state's ``built``: ``trainer.model`` reads it).
        request: What was asked.
    """

    def __init__(self, trainer: TrainerContract, built: dict[str, Any], request: PredictRequest) -> None:
        self.trainer = trainer
        self.built = built
        self.request = request
        self.data: Iterable[Any] = ()
        self.restored: Weights | None = None
        self.outputs: dict[str, torch.Tensor] = {}

    def work(self) -> dict[State, Callable[[], None]]:
        """Each state's work in a predict run."""
        return {State.BUILDING: self.build, State.RESTORING: self.restore, State.PREDICTING: self.predict}

    def build(self) -> None:
        """The work of ``building``: seed, then the predict data and the model, in that order."""
        t = self.trainer
        if t.settings.seed is not None:
            seed_all(t.settings.seed)
        self.data = t.build_predict_data_loader()
        self.built["model"] = t.build_model()

    def restore(self) -> None:
        """The work of ``restoring``: the requested checkpoint's weights into the model."""
        self.restored = restore_model(self.trainer, self.request.checkpoint, self.request.weights)

    def predict(self) -> None:
        """The work of ``predicting``: see :func:`predict_items`."""
        metadata = {"weights": self.request.weights}
        if self.restored is not None:
            metadata["checkpoint"] = str(self.restored.source)
            if self.restored.step is not None:
                metadata["step"] = str(self.restored.step)
        self.outputs = predict_items(self.trainer, self.data, self.request.output, metadata)


def restore_model(trainer: TrainerContract, checkpoint: str | Path | None, weights: str) -> Weights | None:
    """Load a checkpoint's model (or EMA) weights into ``trainer.model``, or ``settings.init_from``'s.

    Args:
        trainer: The trainer, its model built.
        checkpoint: ``None``: ``settings.init_from``'s weights if declared, else the model as
            built; ``"latest"``: the workspace's latest checkpoint (under its checkpointing
            hook's ``path``); else a checkpoint directory (full or sharded), checkpoints root or
            workspace.
        weights: ``"model"``, ``"ema"`` or an EMA hook's name.

    Returns:
        What was loaded (``None``: no checkpoint).

    Raises:
        trainloop.checkpoint.CheckpointError: The checkpoint is missing, corrupt or holds no such weights.
    """
    if checkpoint is None:
        init_from(trainer)
        return None
    source = _latest_root(trainer) if checkpoint == "latest" else Path(checkpoint)
    found = read_weights(source, weights)
    load_weights(trainer.model, found.state_dict, logger=trainer.logger, source=str(found.source))
    at = f" (step {found.step})" if found.step is not None else ""
    trainer.logger.info("Loaded the %s weights of %s%s", weights, found.source, at)
    return found


def _latest_root(trainer: TrainerContract) -> Path:
    """The checkpoints root of ``trainer``'s runs.

    Its declared checkpointing hook's ``path``, else ``<workspace>/checkpoints``.
    """
    declared = [h for h in trainer.settings.hooks if h.type == "checkpointing"]
    path = Path(getattr(declared[0], "path", "checkpoints")) if declared else Path("checkpoints")
    if path.is_absolute():
        return path
    if trainer.workspace is None:
        raise CheckpointError("checkpoint='latest' needs a workspace (or an absolute checkpointing path)")
    return trainer.workspace / path


def predict_items(
    trainer: TrainerContract, data: Iterable[Any], output: Path | None, metadata: dict[str, str]
) -> dict[str, torch.Tensor]:
    """Run ``trainer.predict_step`` over ``data`` and return every item's outputs, in dataset order.

    Args:
        trainer: The trainer, its model built and restored.
        data: The predict data (``build_predict_data_loader()``'s).
        output: The file rank 0 writes (``None``: none).
        metadata: What the file's header records beside the outputs (see ``trainloop.predict.files``).

    Returns:
        Name to tensor, row ``i`` being item ``i`` (see ``trainloop.predict.order`` for a loader
        whose order is not known), on every rank.

    Raises:
        trainloop.predict.order.PredictDataError: The data cannot give every item once, in a known order.
        trainloop.predict.outputs.PredictionError: ``predict_step`` returned something else than
            a tensor or a dict of tensors per item.
    """
    order = item_order(data, rank(), world_size())  # before any batch: a refusal costs nothing
    outputs = PredictionOutputs(f"{type(trainer).__name__}.predict_step()")
    start = perf_counter()
    with module_modes_kept(trainer.model, train=False), torch.no_grad(), trainer.autocast():
        for batch in _with_progress(data):
            outputs.add(trainer.predict_step(batch))
    found = outputs.joined()
    if order.indices is not None:
        assert order.positions is not None
        assert order.length is not None
        found = gather_items(found, order.indices, order.positions, order.length)
    items = next(iter(found.values())).shape[0] if found else 0
    trainer.logger.info("Predicted %d items in %.1f s", items, perf_counter() - start)
    if output is not None and is_rank_zero():
        if output.exists():
            trainer.logger.info("Replacing %s", output)
        write_predictions(found, output, {**metadata, "items": str(items)})
        trainer.logger.info("Wrote the predictions of %d items to %s", items, output)
    return found


def _with_progress(data: Iterable[Any]) -> Iterator[Any]:
    """``data``'s batches, behind a tqdm bar on standard error on rank 0 if it is a terminal."""
    bar: Any = nullcontext()
    stderr = sys.stderr
    if is_rank_zero() and stderr is not None and stderr.isatty():
        try:
            from tqdm import tqdm
        except ImportError:  # the bar is optional
            pass
        else:
            total = len(data) if isinstance(data, Sized) else None
            bar = tqdm(total=total, file=stderr, unit="batch", desc="predict", dynamic_ncols=True)
    with bar:
        for batch in data:
            yield batch
            if bar is not None and hasattr(bar, "update"):
                bar.update()
