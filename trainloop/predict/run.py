"""The work of ``predicting``: ``predict_step`` over the predict data, gathered in dataset order, written once.

The model is in eval mode (each submodule gets its mode back afterwards), under ``torch.no_grad()``
and the trainer's autocast. Rank 0 shows a progress bar (tqdm, when installed and standard error
is a terminal) and writes the file; every rank returns the gathered outputs.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator, Sized
from contextlib import contextmanager
from pathlib import Path
from time import perf_counter
from typing import TYPE_CHECKING, Any

import torch

from trainloop.core.rng import seed_all
from trainloop.core.run_kinds import WeightsSource, init_from, restore_weights
from trainloop.distributed.gather import gather_items
from trainloop.distributed.ranks import is_rank_zero, rank, world_size
from trainloop.machine.table import State
from trainloop.predict.files import PredictionsFileError, output_problem, write_predictions
from trainloop.predict.order import item_order
from trainloop.predict.outputs import PredictionOutputs
from trainloop.utils import module_modes_kept

if TYPE_CHECKING:
    from trainloop.checkpoint.weights import Weights
    from trainloop.core.run_state import RunState, TrainerContract

__all__ = ["PredictRun", "predict_items"]


class PredictRun:
    """The work of a predict run's states: ``building``, ``restoring``, ``predicting``.

    A predict run builds the predict data and the model, nothing else: no training data, no
    optimizer, no hooks (nothing is logged, saved or checkpointed), so nothing is written into
    the checkpoint directory nor into ``metrics.jsonl``.

    Args:
        trainer: The trainer.
        run_state: Its run state (the model goes into ``built``; ``step`` becomes the checkpoint's).
        source: Where the model's weights come from.
        output: The file to write (``None``: none).
    """

    def __init__(
        self, trainer: TrainerContract, run_state: RunState, source: WeightsSource, output: Path | None
    ) -> None:
        self.trainer = trainer
        self.run_state = run_state
        self.source = source
        self.output = output
        self.data: Iterable[Any] = ()
        self.restored: Weights | None = None
        self.outputs: dict[str, torch.Tensor] = {}

    def work(self) -> dict[State, Callable[[], None]]:
        """Each state's work in a predict run."""
        return {State.BUILDING: self.build, State.RESTORING: self.restore, State.PREDICTING: self.predict}

    def build(self) -> None:
        """The work of ``building``: the output checked, then seed, the predict data and the model, in that order.

        Raises:
            PredictionsFileError: The predictions file cannot be written; nothing was built.
        """
        problem = output_problem(self.output)
        if problem is not None:
            raise PredictionsFileError(problem)
        t = self.trainer
        if t.settings.seed is not None:
            seed_all(t.settings.seed)
        self.data = t.build_predict_data_loader()
        self.run_state.built["model"] = t.build_model()

    def restore(self) -> None:
        """The work of ``restoring``: the weights ``source`` names (as an evaluate run restores them)."""
        t = self.trainer
        # No hook is built: the declared checkpointing hooks say where "latest" is.
        roots = [spec.build() for spec in t.settings.hooks if spec.type == "checkpointing"]
        self.restored = found = restore_weights(t, roots, self.source)
        if found is None:
            init_from(t)  # the model as built: a fine-tune's starting weights, if declared
        else:  # the run is of the checkpoint's step and epoch (runs.jsonl records them)
            self.run_state.step = found.step if found.step is not None else 0
            self.run_state.epoch = found.epoch if found.epoch is not None else 0

    def predict(self) -> None:
        """The work of ``predicting``: see :func:`predict_items`."""
        metadata = {"weights": self.source.weights}
        if self.restored is not None:
            metadata["checkpoint"] = str(self.restored.source)
            if self.restored.step is not None:
                metadata["step"] = str(self.restored.step)
        self.outputs = predict_items(self.trainer, self.data, self.output, metadata)


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
    with _progress_bar(data) as bar, module_modes_kept(trainer.model, train=False), torch.no_grad(), trainer.autocast():
        for batch in data:
            outputs.add(trainer.predict_step(batch))
            if bar is not None:
                bar.update()
    found = outputs.joined()
    if order is not None:
        found = gather_items(found, order.indices, order.positions, order.length)
    items = next(iter(found.values())).shape[0] if found else 0
    trainer.logger.info("Predicted %d items in %.1f s", items, perf_counter() - start)
    if output is not None and is_rank_zero():
        if output.exists():
            trainer.logger.info("Replacing %s", output)
        write_predictions(found, output, {**metadata, "items": str(items)})
        trainer.logger.info("Wrote the predictions of %d items to %s", items, output)
    return found


@contextmanager
def _progress_bar(data: Iterable[Any]) -> Iterator[Any]:
    """A tqdm bar over ``data``'s batches on standard error, on rank 0 if it is a terminal; else ``None``."""
    stderr = sys.stderr
    if not is_rank_zero() or stderr is None or not stderr.isatty():
        yield None
        return
    try:
        from tqdm import tqdm
    except ImportError:  # the bar is optional
        yield None
        return
    total = len(data) if isinstance(data, Sized) else None
    with tqdm(total=total, file=stderr, unit="batch", desc="predict", dynamic_ncols=True) as bar:
        yield bar
