"""Train an MLP on scikit-learn's bundled digits dataset (real data, no download).

    python examples/digits/train.py                      # settings from settings.json beside this file
    python examples/digits/train.py my_settings.json     # or your own file

Prints progress and the validation loss and accuracy while training, then the final accuracy
(about 97%) and the best checkpoint by validation loss. Checkpoints go to
``runs/digits/checkpoints``; run it again and it resumes from the latest one (Ctrl-C saves and
exits cleanly; the next run continues from there). The run records its trace and metrics in
``runs/digits``; see them as a page with::

    trainloop report runs/digits        # writes runs/digits/report.html
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import torch
from pydantic import Field
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainloop import BaseTrainer, TrainerSettings


class DigitsSettings(TrainerSettings):
    """The trainer's settings plus this example's own knobs."""

    hidden_dim: int = Field(128, gt=0)
    batch_size: int = Field(64, gt=0)
    seed: int = 0


def load_split(seed: int) -> tuple[TensorDataset, TensorDataset]:
    """The 1,797 8x8 digit images, scaled to [0, 1], split 80/20 (stratified)."""
    x, y = load_digits(return_X_y=True)
    x_train, x_val, y_train, y_val = train_test_split(x / 16.0, y, test_size=0.2, random_state=seed, stratify=y)

    def as_dataset(x, y):
        return TensorDataset(torch.tensor(x, dtype=torch.float32), torch.tensor(y))

    return as_dataset(x_train, y_train), as_dataset(x_val, y_val)


class DigitsTrainer(BaseTrainer):
    """A 64-hidden-10 MLP classifier."""

    settings_class = DigitsSettings
    settings: DigitsSettings

    def build_data_loader(self):
        torch.manual_seed(self.settings.seed)
        self.train_set, self.val_set = load_split(self.settings.seed)
        return DataLoader(self.train_set, batch_size=self.settings.batch_size, shuffle=True)

    def build_model(self):
        hidden = self.settings.hidden_dim
        return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10)).to(self.device)

    def build_lr_scheduler(self):
        return torch.optim.lr_scheduler.CosineAnnealingLR(
            self.optimizer, T_max=self.max_steps
        )  # planned: max_epochs works too

    def forward(self, batch):
        x, y = (t.to(self.device) for t in batch)
        logits = self.model(x)
        loss = nn.functional.cross_entropy(logits, y)
        return loss, {"accuracy": (logits.argmax(1) == y).float().mean()}

    @torch.no_grad()
    def val_metrics(self) -> dict[str, float]:
        """Validation loss and accuracy over the held-out 20%."""
        x, y = (t.to(self.device) for t in self.val_set.tensors)
        logits = self.model(x)
        return {
            "loss": nn.functional.cross_entropy(logits, y).item(),
            "accuracy": (logits.argmax(1) == y).float().mean().item(),
        }


def main(argv: list[str]) -> float:
    """Train from a settings file and return the validation accuracy."""
    path = Path(argv[0]) if argv else Path(__file__).with_name("settings.json")
    settings = DigitsSettings.from_file(path)
    trainer = DigitsTrainer(settings)
    result = trainer.train()
    # An evaluate run: the latest checkpoint's weights, every validation once (also when resumed
    # with nothing left to train). From the repository root, where README's command ran this,
    # `trainloop evaluate examples/digits/settings.json --trainer examples.digits.train:DigitsTrainer`
    # does the same.
    metrics = DigitsTrainer(settings).evaluate()
    accuracy, loss = metrics["val/accuracy"], metrics["val/loss"]
    print(f"validation accuracy {accuracy:.4f} (loss {loss:.4f}) after {result.step} steps")
    print(f"best checkpoint: {result.best_checkpoint}; report: trainloop report {settings.workspace}")
    return accuracy


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    main(sys.argv[1:])
