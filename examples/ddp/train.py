"""Data-parallel training (DDP) of an MLP on scikit-learn's digits, launched by torchrun.

    torchrun --standalone --nproc_per_node=2 examples/ddp/train.py --workspace runs/ddp
    python examples/ddp/train.py                   # the same script, alone in one process
    torchrun --standalone --nproc_per_node=1 examples/ddp/train.py --workspace runs/ddp --accumulation 2
                                                   # resumed on 1 rank: the same 64 images per step

Each rank draws its own shard of every epoch (DistributedSampler); DDP averages the gradients,
so a step sees ``ranks x batch_size`` images. Rank 0 logs progress, writes the checkpoints
(run it again to resume from the latest) and prints the final validation accuracy.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from trainloop import BaseTrainer, CheckpointingHook, ProgressHook
from trainloop.distributed import init_distributed, is_main, rank, world_size, wrap_model


def load_split() -> tuple[TensorDataset, TensorDataset]:
    """The 1,797 8x8 digit images scaled to [0, 1], split 80/20 (the same on every rank)."""
    x, y = load_digits(return_X_y=True)
    x_train, x_val, y_train, y_val = train_test_split(x / 16.0, y, test_size=0.2, random_state=0, stratify=y)

    def as_dataset(x, y):
        return TensorDataset(torch.tensor(x, dtype=torch.float32), torch.tensor(y))

    return as_dataset(x_train, y_train), as_dataset(x_val, y_val)


class DigitsTrainer(BaseTrainer):
    """A 64-128-10 MLP classifier, wrapped by DDP when there are several ranks."""

    def build_data_loader(self):
        self.train_set, self.val_set = load_split()
        # The sampler shards (and, through set_epoch, reshuffles) each epoch; alone it is 1 of 1.
        sampler = DistributedSampler(self.train_set, num_replicas=world_size(), rank=rank(), seed=0)
        return DataLoader(self.train_set, batch_size=32, sampler=sampler)

    def build_model(self):
        torch.manual_seed(0)  # DDP broadcasts rank 0's weights anyway; this keeps runs repeatable
        model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)).to(self.device)
        return wrap_model(model, "auto")  # DDP under torchrun, the model itself alone

    def build_optimizer(self):
        return torch.optim.AdamW(self.model.parameters(), lr=3e-3, weight_decay=1e-4)

    def build_hooks(self):
        return [
            ProgressHook(interval=50, sync=True),  # the loss averaged over ranks; rank 0 logs it
            CheckpointingHook(interval=100),  # every rank builds the state dict, rank 0 writes it
        ]

    def forward(self, batch):
        x, y = (t.to(self.device) for t in batch)
        loss = nn.functional.cross_entropy(self.model(x), y)
        return loss, {}

    @torch.no_grad()
    def accuracy(self) -> float:
        """Accuracy over the whole validation set (every rank computes the same)."""
        self.model.eval()
        x, y = (t.to(self.device) for t in self.val_set.tensors)
        return (self.model(x).argmax(1) == y).float().mean().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--workspace", type=Path, default=Path("runs/ddp"))
    parser.add_argument("--max-steps", type=int, default=150)
    parser.add_argument("--accumulation", type=int, default=1, help="gradient_accumulation_steps")
    args = parser.parse_args()

    with init_distributed() as ctx:  # the process group from torchrun's environment, if any
        logging.basicConfig(level=logging.INFO if is_main() else logging.WARNING, format="%(message)s")
        trainer = DigitsTrainer(
            max_steps=args.max_steps,
            gradient_accumulation_steps=args.accumulation,
            grad_clip=1.0,
            workspace=args.workspace,
            device=str(ctx.device),
        )
        trainer.train()
        accuracy = trainer.accuracy()
        if ctx.is_main:
            print(f"final accuracy {accuracy:.4f} after {trainer.step} steps on {ctx.world_size} ranks")


if __name__ == "__main__":
    main()
