"""Train a small GAN on a ring of eight Gaussians: two optimizers, one update each per step.

    python examples/gan/train.py                      # settings from settings.json beside this file
    python examples/gan/train.py my_settings.json     # or your own file

The settings declare the two optimizers by name (``"optimizers"``), each over its own submodule;
every step updates the discriminator, then the generator, on the same batch of real points, and
calls ``forward(batch, optimizer)`` once per update with the optimizer's name, as PyTorch's DCGAN
example does by hand. The run logs ``loss/discriminator`` and ``loss/generator``, checkpoints to
``runs/gan/checkpoints`` (run it again and it resumes), and draws the generator's samples beside
the real points in ``runs/gan/samples.png``.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
from pydantic import Field
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainloop import BaseTrainer, TrainerSettings

MODES = 8
"""The Gaussians, evenly spaced on a circle of radius 2."""


class GanSettings(TrainerSettings):
    """The trainer's settings plus this example's own knobs."""

    samples: int = Field(4096, gt=0)
    batch_size: int = Field(128, gt=0)
    noise_dim: int = Field(8, gt=0)
    hidden_dim: int = Field(64, gt=0)


def ring(n: int, generator: torch.Generator) -> torch.Tensor:
    """``n`` points from eight Gaussians (standard deviation 0.05) on a circle of radius 2."""
    angles = torch.randint(0, MODES, (n,), generator=generator) * (2 * math.pi / MODES)
    centres = 2.0 * torch.stack([angles.cos(), angles.sin()], dim=1)
    return centres + 0.05 * torch.randn(n, 2, generator=generator)


def mlp(inputs: int, hidden: int, outputs: int) -> nn.Sequential:
    layers = [nn.Linear(inputs, hidden), nn.LeakyReLU(0.2), nn.Linear(hidden, hidden), nn.LeakyReLU(0.2)]
    return nn.Sequential(*layers, nn.Linear(hidden, outputs))


class Gan(nn.Module):
    """A generator (noise to points) and a discriminator (a point to a logit: real or not)."""

    def __init__(self, noise_dim: int, hidden: int) -> None:
        super().__init__()
        self.noise_dim = noise_dim
        self.generator = mlp(noise_dim, hidden, 2)
        self.discriminator = mlp(2, hidden, 1)

    def sample(self, n: int) -> torch.Tensor:
        return self.generator(torch.randn(n, self.noise_dim, device=next(self.parameters()).device))


class GanTrainer(BaseTrainer):
    """The two players of a GAN, each stepped by its own optimizer (declared in the settings)."""

    settings_class = GanSettings
    settings: GanSettings

    def build_data_loader(self):
        points = ring(self.settings.samples, torch.Generator().manual_seed(1))
        return DataLoader(TensorDataset(points), batch_size=self.settings.batch_size, shuffle=True, drop_last=True)

    def build_model(self):
        return Gan(self.settings.noise_dim, self.settings.hidden_dim).to(self.device)

    def forward(self, batch, optimizer):
        (real,) = batch
        real = real.to(self.device)
        gan = self.model
        fake = gan.sample(len(real))
        bce = nn.functional.binary_cross_entropy_with_logits
        if optimizer == "discriminator":  # tell real from fake; the generator is not trained here
            real_logits, fake_logits = gan.discriminator(real), gan.discriminator(fake.detach())
            loss = bce(real_logits, torch.ones_like(real_logits)) + bce(fake_logits, torch.zeros_like(fake_logits))
            return loss, {"d_real": real_logits.sigmoid().mean().detach()}
        # The generator's turn: the discriminator it fools was just updated in this step.
        logits = gan.discriminator(fake)
        return bce(logits, torch.ones_like(logits)), {}


def mode_coverage(points: torch.Tensor) -> int:
    """How many of the eight modes have a generated point within 0.5 of their centre."""
    angles = torch.arange(MODES) * (2 * math.pi / MODES)
    centres = 2.0 * torch.stack([angles.cos(), angles.sin()], dim=1)
    return int((torch.cdist(centres, points).min(dim=1).values < 0.5).sum())


def draw(real: torch.Tensor, fake: torch.Tensor, path: Path) -> None:
    """The real points and the generator's samples, one scatter plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 5))
    ax.scatter(*real.T, s=4, alpha=0.3, label="real")
    ax.scatter(*fake.T, s=4, alpha=0.5, label="generated")
    ax.set_aspect("equal")
    ax.legend(loc="upper right")
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str]) -> int:
    path = Path(argv[0]) if argv else Path(__file__).with_name("settings.json")
    trainer = GanTrainer(GanSettings.from_file(path))
    trainer.train()
    torch.manual_seed(2)
    with torch.no_grad():
        fake = trainer.model.sample(1024).cpu()
    real = ring(1024, torch.Generator().manual_seed(3))
    covered = mode_coverage(fake)
    if trainer.workspace is not None:
        draw(real, fake, trainer.workspace / "samples.png")
    print(f"modes covered: {covered} of {MODES}")
    return covered


if __name__ == "__main__":
    main(sys.argv[1:])
