"""Fully sharded training (FSDP2, ``fully_shard``) of a residual MLP on scikit-learn's digits.

    torchrun --standalone --nproc_per_node=2 examples/fsdp/train.py --workspace runs/fsdp

Every ``Block`` is its own sharding group and the root holds the rest: each rank stores half of
every weight, gathers a block's full weights just before using it, and reduce-scatters its
gradients. It runs on the CPU with the gloo backend as well as on GPUs with nccl. Checkpoints
hold full tensors (gathered to rank 0, which writes them), so they load into a plain model too;
run it again to resume from the latest. Rank 0 prints the final validation accuracy.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from trainloop import BaseTrainer, CheckpointingHook, ProgressHook
from trainloop.distributed import init_distributed, is_main, wrap_model


def load_split() -> tuple[TensorDataset, TensorDataset]:
    """The 1,797 8x8 digit images scaled to [0, 1], split 80/20 (the same on every rank)."""
    x, y = load_digits(return_X_y=True)
    x_train, x_val, y_train, y_val = train_test_split(x / 16.0, y, test_size=0.2, random_state=0, stratify=y)

    def as_dataset(x, y):
        return TensorDataset(torch.tensor(x, dtype=torch.float32), torch.tensor(y))

    return as_dataset(x_train, y_train), as_dataset(x_val, y_val)


class Block(nn.Module):
    """A residual layer: the unit of sharding (as a transformer layer would be)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.linear(x))


class DigitsTrainer(BaseTrainer):
    """64 -> 128, two residual blocks, -> 10; each block sharded on its own, then the root."""

    def build_data_loader(self):
        self.train_set, self.val_set = load_split()
        return DataLoader(self.train_set, batch_size=32, sampler=DistributedSampler(self.train_set, seed=0))

    def build_model(self):
        # fully_shard keeps each rank's slice of the weights it is given, and does not broadcast:
        # every rank must build the same initial weights.
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), Block(128), Block(128), nn.Linear(128, 10))
        return wrap_model(model.to(self.device), "fsdp", shard_modules=(Block,))

    def build_optimizer(self):
        # Built on the sharded parameters: each rank keeps optimizer state for its slices only.
        return torch.optim.AdamW(self.model.parameters(), lr=3e-3, weight_decay=1e-4)

    def build_hooks(self):
        return [
            ProgressHook(interval=50, sync=True),  # the loss averaged over ranks; rank 0 logs it
            CheckpointingHook(interval=100),  # every rank gathers the state dict, rank 0 writes it
        ]

    def forward(self, batch):
        x, y = (t.to(self.device) for t in batch)
        loss = nn.functional.cross_entropy(self.model(x), y)
        return loss, {}

    @torch.no_grad()
    def accuracy(self) -> float:
        """Accuracy over the whole validation set; every rank runs it (forward gathers weights)."""
        self.model.eval()
        x, y = (t.to(self.device) for t in self.val_set.tensors)
        return (self.model(x).argmax(1) == y).float().mean().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--workspace", type=Path, default=Path("runs/fsdp"))
    parser.add_argument("--max-steps", type=int, default=150)
    args = parser.parse_args()

    with init_distributed() as ctx:  # gloo on the CPU, nccl on GPUs
        logging.basicConfig(level=logging.INFO if is_main() else logging.WARNING, format="%(message)s")
        trainer = DigitsTrainer(
            max_steps=args.max_steps,
            workspace=args.workspace,
            device=str(ctx.device),
            # Full tensors, gathered to rank 0 and kept on the CPU: what CheckpointingHook writes.
            # (Loading such a state dict needs an optimizer with state, e.g. AdamW: torch 2.13's
            # set_state_dict fails on a full state dict of plain SGD.)
            state_dict_options=StateDictOptions(full_state_dict=True, cpu_offload=True),
        )
        trainer.train()
        accuracy = trainer.accuracy()
        if ctx.is_main:
            print(f"final accuracy {accuracy:.4f} after {trainer.step} steps on {ctx.world_size} ranks")


if __name__ == "__main__":
    main()
