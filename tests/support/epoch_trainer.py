"""A trainer that records which samples each step trains on, to compare a stopped-and-resumed run with the unbroken one.

``SampleTrainer`` draws a dataset of 24 indexed items through whatever loader ``loader(dataset)``
builds, with dropout (torch's global generator at every forward) and Adam (optimizer state), so a
resume that draws one random number more or less, or one other sample, ends with other weights.
``compare`` runs the unbroken run and the stopped one (a save, then a new trainer resumed from it)
and returns what each drew and ended with.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from tiny_trainer import TinyTrainer, make_data
from torch import nn
from torch.utils.data import DataLoader, Dataset

from trainloop import BaseHook
from trainloop.hooks.checkpointing import CheckpointingHook

ITEMS = 24
SEED = 7


class Indexed(Dataset):
    """``make_data(length)``'s items, each with its index: a batch says which samples it holds."""

    def __init__(self, length: int = ITEMS) -> None:
        self.data = make_data(length)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        x, y = self.data[index]
        return x, y, index


def shuffled(dataset: Dataset) -> DataLoader:
    """A shuffled DataLoader of 4 items a batch (6 batches an epoch): shuffling draws from torch's global generator."""
    return DataLoader(dataset, batch_size=4, shuffle=True)


class SampleTrainer(TinyTrainer):
    """Records, per step, the indices of the samples its microsteps trained on (``samples[step]``).

    Args:
        loader: Builds the data loader from the dataset (``shuffled`` if omitted).
        items: The dataset's length.
        skip: Indices whose batch ``forward`` skips (``loss=None``) when the batch holds any of them.
    """

    def __init__(self, *args: Any, loader: Callable[[Dataset], Any] = shuffled, items: int = ITEMS,
                 skip: frozenset[int] = frozenset(), **kwargs: Any) -> None:
        kwargs.setdefault("seed", SEED)
        kwargs.setdefault("make_optimizer", lambda params, lr: torch.optim.Adam(params, lr=0.01))
        super().__init__(*args, **kwargs)
        self.make_loader, self.items, self.skip = loader, items, skip
        self.samples: dict[int, list[int]] = {}

    def build_data_loader(self) -> Any:
        return self.make_loader(Indexed(self.items))

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1))

    def forward(self, batch: Any) -> Any:
        x, y, index = batch
        index = [int(i) for i in index]
        if self.skip.intersection(index):
            return None, {}
        self.samples.setdefault(self.step, []).extend(index)
        loss = nn.functional.mse_loss(self.model(x), y)
        return loss, {}


@dataclass
class Ended:
    """What a run (or a stopped run and its resume together) trained on and ended with."""

    samples: dict[int, list[int]]
    weights: list[torch.Tensor]
    optimizer: dict[str, Any]
    trainers: list[SampleTrainer] = field(default_factory=list)

    def assert_same_as(self, other: Ended) -> None:
        """The same samples at every step, and weights and optimizer state ``torch.equal``."""
        assert self.samples == other.samples
        for mine, theirs in zip(self.weights, other.weights, strict=True):
            assert torch.equal(mine, theirs), (mine - theirs).abs().max()
        assert_equal_states(self.optimizer, other.optimizer)


def assert_equal_states(a: Any, b: Any) -> None:
    """Nested state dicts equal, tensors ``torch.equal``."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        assert torch.equal(a, b), (a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_equal_states(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_equal_states(x, y)
    else:
        assert a == b


def ended(*trainers: SampleTrainer) -> Ended:
    """What these runs, one after another (a stopped run, then its resumes), trained on and ended with."""
    samples: dict[int, list[int]] = {}
    for trainer in trainers:
        samples.update(trainer.samples)
    last = trainers[-1]
    return Ended(
        samples,
        [p.detach().clone() for p in last.model.parameters()],
        last.optimizer.state_dict(),
        list(trainers),
    )


def run(workspace: Any = None, hooks: list[BaseHook] | None = None, **kwargs: Any) -> SampleTrainer:
    """Train a ``SampleTrainer`` to its end and return it."""
    trainer = SampleTrainer(workspace=workspace, hooks=hooks, **kwargs)
    trainer.train()
    return trainer


def compare(tmp_path: Any, stopped: dict[str, Any], resumed: dict[str, Any], unbroken: dict[str, Any] | None = None,
            hooks: Callable[[], list[BaseHook]] = lambda: [], save: Callable[[], BaseHook] | None = None,
            **common: Any) -> tuple[Ended, Ended]:
    """The unbroken run, and the run stopped after ``stopped``'s end and resumed with ``resumed``'s settings.

    ``save`` makes the stopped run's saving hook (``CheckpointingHook(interval=1)`` if omitted); the resumed run
    loads with a hook that never saves again. ``unbroken`` defaults to ``resumed``'s settings.
    """
    save = save or (lambda: CheckpointingHook(interval=1, keep_previous=100))
    whole = run(**{**common, **(unbroken or resumed)}, hooks=hooks())
    first = run(tmp_path, [*hooks(), save()], **common, **stopped)
    second = run(tmp_path, [*hooks(), CheckpointingHook(interval=10_000)], **common, **resumed)
    return ended(whole), ended(first, second)
