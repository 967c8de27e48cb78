"""The digits run of examples/digits, declared in a cfgx config whose "type" entries specbuild builds.

    python examples/config_builder/train.py                                  # config.py beside this file
    python examples/config_builder/train.py examples/config_builder/quick.py # a variant composed on it
    python examples/config_builder/train.py hidden_dim=64 trainer.max_steps=200   # cfgx overrides

Arguments with ``=`` are cfgx overrides, the others config files (composed in order). cfgx
resolves the files and overrides into one plain dict; specbuild builds its ``trainer`` entry:
``type`` names the trainer class and every other key becomes one of its settings, validated by
``TrainerSettings`` like any trainloop run. The ``data``, ``model``, ``optimizer`` and
``lr_scheduler`` settings are specbuild specs themselves; the trainer builds them in its
``build_*`` methods, so they are built in the ``building`` state, after the seed is set. The hooks
keep trainloop's own declaration. Prints the validation accuracy (about 97%).
"""

# No ``from __future__ import annotations``: pydantic resolves the ``Spec`` annotation of the
# settings when the class is defined, also when this file is loaded outside ``sys.modules``.
import importlib
import logging
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Annotated, Any

import cfgx
import specbuild
import torch
from pydantic import AfterValidator, JsonValue, field_validator
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainloop import BaseTrainer, TrainerSettings

PARTIAL = "partial:"


def _specs(value: Any, path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every mapping with a ``"type"`` in ``value``, nested ones included, with where it is."""
    if isinstance(value, dict):
        if "type" in value:
            yield path, value
        for key, item in value.items():
            yield from _specs(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _specs(item, f"{path}[{i}]")


def _resolvable(spec: dict[str, Any]) -> dict[str, Any]:
    """Check that the spec's ``type``, and every nested one, names something specbuild can build.

    specbuild itself would only fail when the trainer builds the component; this fails while
    the settings are validated, before anything runs.
    """
    if not isinstance(spec.get("type"), str):
        raise ValueError('a component needs a "type": a name registered with specbuild or a dotted import path')
    for where, nested in _specs(spec, ""):
        name = nested["type"]
        if not isinstance(name, str):
            raise ValueError(f"{where or 'type'}: type must be a string, got {type(name).__name__}")
        name = name.removeprefix(PARTIAL)
        if specbuild.REGISTRY.get(name) is not None:
            continue
        module, _, attr = name.rpartition(".")
        try:
            found = bool(module) and hasattr(importlib.import_module(module), attr)
        except ImportError:
            found = False
        if not found:
            raise ValueError(
                f"{where + ': ' if where else ''}type {name!r} is neither registered with specbuild "
                "nor an importable dotted path"
            )
    return spec


#: A specbuild spec in the settings: JSON data, so the settings save and compare as JSON.
Spec = Annotated[dict[str, JsonValue], AfterValidator(_resolvable)]


class SpecSettings(TrainerSettings):
    """The trainer's settings, whose components are specbuild specs.

    ``optimizer`` replaces trainloop's declared optimizer (``{"name": "AdamW", ...}``) by a
    specbuild factory; the ``lr_schedule`` setting stays available but this config uses
    ``lr_scheduler`` instead.
    """

    data: Spec
    """Builds an object with ``train_loader()`` and ``val_set``."""
    model: Spec
    """Builds the ``nn.Module``."""
    optimizer: Spec  # type: ignore[assignment]
    """A ``partial:`` spec: called with the model's parameters."""
    lr_scheduler: Spec | None = None
    """A ``partial:`` spec: called with the optimizer."""

    @field_validator("optimizer", "lr_scheduler")
    @classmethod
    def _is_factory(cls, spec: dict[str, Any] | None, info: Any) -> dict[str, Any] | None:
        if spec is not None and not spec["type"].startswith(PARTIAL):
            raise ValueError(
                f'{info.field_name} must be a factory: write "type": "{PARTIAL}{spec["type"]}" '
                f"(the trainer calls it with what it needs)"
            )
        return spec


@specbuild.register()
class DigitsData:
    """scikit-learn's 1,797 8x8 digit images, scaled to [0, 1], split stratified.

    Args:
        batch_size: Training batch size.
        val_fraction: The share held out for validation.
        split_seed: Seeds the split (the shuffling follows the trainer's seed).
    """

    def __init__(self, batch_size: int, val_fraction: float = 0.2, split_seed: int = 0) -> None:
        x, y = load_digits(return_X_y=True)
        x_train, x_val, y_train, y_val = train_test_split(
            x / 16.0, y, test_size=val_fraction, random_state=split_seed, stratify=y
        )
        self.batch_size = batch_size
        self.train_set = TensorDataset(torch.tensor(x_train, dtype=torch.float32), torch.tensor(y_train))
        self.val_set = TensorDataset(torch.tensor(x_val, dtype=torch.float32), torch.tensor(y_val))

    def train_loader(self) -> DataLoader:
        """The shuffled training batches."""
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)


@specbuild.register()
class DigitsTrainer(BaseTrainer):
    """A classifier whose data, model, optimizer and schedule are built from specbuild specs."""

    settings_class = SpecSettings
    settings: SpecSettings

    def build_data_loader(self):
        self.data = specbuild.build(self.settings.data)
        return self.data.train_loader()

    def build_model(self):
        return specbuild.build(self.settings.model).to(self.device)

    def build_optimizer(self):
        return specbuild.build(self.settings.optimizer)(self.model.parameters())

    def build_lr_scheduler(self):
        if self.settings.lr_scheduler is None:
            return None
        return specbuild.build(self.settings.lr_scheduler)(self.optimizer)

    def forward(self, batch):
        x, y = (t.to(self.device) for t in batch)
        logits = self.model(x)
        loss = nn.functional.cross_entropy(logits, y)
        return loss, {"accuracy": (logits.argmax(1) == y).float().mean()}

    @torch.no_grad()
    def val_metrics(self) -> dict[str, float]:
        """Validation loss and accuracy over the held-out digits."""
        x, y = (t.to(self.device) for t in self.data.val_set.tensors)
        logits = self.model(x)
        return {
            "loss": nn.functional.cross_entropy(logits, y).item(),
            "accuracy": (logits.argmax(1) == y).float().mean().item(),
        }


def build_trainer(sources: Sequence[str | Path], overrides: Sequence[str] = ()) -> BaseTrainer:
    """Load the config (cfgx) and build its ``trainer`` entry (specbuild).

    Args:
        sources: cfgx config files, composed in order.
        overrides: cfgx overrides (``key.sub=value``, ``key!=``, ``expr:...``).

    Raises:
        pydantic.ValidationError: A setting is invalid; the error names it.
        TypeError: The ``trainer`` entry did not build a ``BaseTrainer``.
    """
    config = cfgx.load(*sources, overrides=list(overrides))
    # Not recursive: the trainer's settings hold specs (and hooks) as data, built later by
    # the trainer itself in the building state.
    trainer = specbuild.build(config["trainer"], recursive=False)
    if not isinstance(trainer, BaseTrainer):
        raise TypeError(f"the config's trainer entry built a {type(trainer).__name__}, not a BaseTrainer")
    return trainer


def main(argv: list[str]) -> float:
    """Train from config files and overrides and return the validation accuracy."""
    sources = [arg for arg in argv if "=" not in arg] or [Path(__file__).with_name("config.py")]
    overrides = [arg for arg in argv if "=" in arg]
    trainer = build_trainer(sources, overrides)
    trainer.train()
    metrics = trainer.val_metrics()  # the trained model, in this process
    print(f"validation accuracy {metrics['accuracy']:.4f} (loss {metrics['loss']:.4f}) after {trainer.step} steps")
    return metrics["accuracy"]


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    main(sys.argv[1:])
