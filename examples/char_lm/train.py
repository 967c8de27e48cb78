"""Train a tiny character-level transformer on this repository's own documentation.

    python examples/char_lm/train.py                      # settings from settings.json beside this file
    python examples/char_lm/train.py my_settings.json     # or your own file

The text is README.md and docs/*.md, read at run time (no download). Training runs under bf16
autocast with gradient accumulation, a warmed-up cosine schedule and an AdamW optimizer declared
in the settings, and an exponential moving average of the weights (EmaHook). Sequences have
random lengths and are padded; ``forward`` returns ``Loss(sum, count)`` over the real characters
only, so every character weighs the same however the batches are padded and accumulated. At the
end the EMA model writes a sample and is scored in bits per character on the held-out text.
"""

# No ``from __future__ import annotations``: pydantic resolves the settings' annotations when
# the class is defined, also when this file is loaded outside ``sys.modules``.
import contextlib
import logging
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import torch
from pydantic import Field, model_validator
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

from trainloop import BaseTrainer, EmaHook, Loss, TrainerSettings
from trainloop.settings import NonNegativeFloat, PositiveInt

ROOT = Path(__file__).resolve().parents[2]

AtLeastTwo = Annotated[int, Field(gt=1, strict=True)]


class CharLMSettings(TrainerSettings):
    """The trainer's settings plus this example's own knobs."""

    context: AtLeastTwo = 32
    """Longest training sequence, and the model's attention window, in characters."""
    min_length: PositiveInt = 8
    """Shortest training sequence, in characters."""
    stride: PositiveInt = 12
    """Characters between the starts of two training sequences (they overlap when shorter)."""
    batch_size: PositiveInt = 8
    val_every: AtLeastTwo = 10
    """Every ``val_every``-th block of the text is held out for validation."""
    block: AtLeastTwo = 256
    """Length of those blocks, in characters."""
    d_model: PositiveInt = 64
    n_heads: PositiveInt = 4
    n_layers: PositiveInt = 2
    ff_mult: PositiveInt = 2
    """Width of each feed-forward block, as a multiple of ``d_model``."""
    prompt: Annotated[str, Field(min_length=1, strict=True)] = "The trainer"
    """The text the sample continues."""
    sample_length: PositiveInt = 160
    """Characters to write after the prompt."""
    temperature: NonNegativeFloat = 0.0
    """0: greedy decoding; above 0: sampling (seeded by ``seed``)."""

    @model_validator(mode="after")
    def _lengths_fit(self) -> "CharLMSettings":
        if self.min_length > self.context:
            raise ValueError(f"min_length ({self.min_length}) must not exceed context ({self.context})")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be a multiple of n_heads ({self.n_heads})")
        return self


def load_text() -> str:
    """The repository's README.md and docs/*.md, joined (their order is fixed)."""
    paths = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return "\n\n".join(path.read_text(encoding="utf-8") for path in paths)


class CharCodec:
    """Characters to ids and back; the vocabulary is the text's distinct characters."""

    def __init__(self, text: str) -> None:
        self.chars = sorted(set(text))
        self.ids = {c: i for i, c in enumerate(self.chars)}

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        """The ids of ``text``; ``ValueError`` names a character outside the vocabulary."""
        unknown = sorted(set(text) - self.ids.keys())
        if unknown:
            raise ValueError(f"characters not in the vocabulary: {''.join(unknown)!r}")
        return torch.tensor([self.ids[c] for c in text], dtype=torch.long)

    def decode(self, ids: torch.Tensor) -> str:
        """The text of ``ids``."""
        return "".join(self.chars[i] for i in ids.tolist())


def split(ids: torch.Tensor, block: int, val_every: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Training and validation segments: every ``val_every``-th block of ``block`` characters
    is held out, so both sets sample every document."""
    train, val = [], []
    stride = block * val_every
    for start in range(0, len(ids), stride):
        train.append(ids[start : start + stride - block])
        val.append(ids[start + stride - block : start + stride])
    return [t for t in train if len(t) > 1], [v for v in val if len(v) > 1]


def training_sequences(
    segments: list[torch.Tensor], settings: CharLMSettings, generator: torch.Generator
) -> list[torch.Tensor]:
    """Pieces of each segment starting every ``stride`` characters, of random lengths in
    [min_length, context] (plus the one character their last position predicts)."""
    pieces = []
    for ids in segments:
        for start in range(0, len(ids) - settings.min_length, settings.stride):
            length = int(torch.randint(settings.min_length, settings.context + 1, (), generator=generator))
            pieces.append(ids[start : start + length + 1])
    return pieces


def validation_sequences(segments: list[torch.Tensor], context: int) -> list[torch.Tensor]:
    """Consecutive pieces of each segment sharing one character, so every character but a
    segment's first is predicted exactly once."""
    return [ids[start : start + context + 1] for ids in segments for start in range(0, len(ids) - 1, context)]


def pad_collate(pieces: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inputs and targets padded to the longest piece, and the mask of real target positions."""
    longest = max(len(p) for p in pieces) - 1
    inputs = torch.zeros(len(pieces), longest, dtype=torch.long)
    targets = torch.zeros(len(pieces), longest, dtype=torch.long)
    mask = torch.zeros(len(pieces), longest)
    for row, piece in enumerate(pieces):
        n = len(piece) - 1
        inputs[row, :n], targets[row, :n], mask[row, :n] = piece[:-1], piece[1:], 1.0
    return inputs, targets, mask


class CharTransformer(nn.Module):
    """A causal transformer over characters: learned positions, pre-norm encoder layers.

    Each position's input also holds the previous character's embedding (a "token shift"):
    the bigram signal that attention alone takes a tiny model hundreds of steps to find.
    """

    def __init__(self, vocab: int, context: int, d_model: int, n_heads: int, n_layers: int, ff_mult: int) -> None:
        super().__init__()
        self.context = context
        self.embed = nn.Embedding(vocab, d_model)
        self.previous = nn.Embedding(vocab, d_model)
        self.position = nn.Embedding(context, d_model)
        layer = nn.TransformerEncoderLayer(
            d_model, n_heads, ff_mult * d_model, dropout=0.0, batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        length = ids.shape[1]
        previous = F.pad(self.previous(ids[:, :-1]), (0, 0, 1, 0))  # position 0 has none
        x = self.embed(ids) + previous + self.position(torch.arange(length, device=ids.device))
        # Padding sits after the real characters, so the causal mask alone keeps it out of
        # every real position's attention: no key padding mask is needed.
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=ids.device)
        return self.head(self.norm(self.encoder(x, mask=mask, is_causal=True)))


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` in eval mode for the block, then back in the mode it had."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


class CharLMTrainer(BaseTrainer):
    """Next-character prediction; the optimizer and lr schedule come from the settings."""

    settings_class = CharLMSettings
    settings: CharLMSettings

    def build_data_loader(self):
        text = load_text()
        self.codec = CharCodec(text)
        self.codec.encode(self.settings.prompt)  # a prompt it cannot encode fails now, not after training
        ids = self.codec.encode(text)
        train, val = split(ids, self.settings.block, self.settings.val_every)
        pieces = training_sequences(train, self.settings, torch.Generator().manual_seed(self.settings.seed or 0))
        self.val_batch = pad_collate(validation_sequences(val, self.settings.context))
        return DataLoader(pieces, batch_size=self.settings.batch_size, shuffle=True, collate_fn=pad_collate)

    def build_model(self):
        s = self.settings
        return CharTransformer(len(self.codec), s.context, s.d_model, s.n_heads, s.n_layers, s.ff_mult).to(self.device)

    # build_optimizer and build_lr_scheduler: the defaults build settings.optimizer and
    # settings.lr_schedule.

    def forward(self, batch):
        inputs, targets, mask = (t.to(self.device) for t in batch)
        logits = self.model(inputs)
        losses = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none")
        mask = mask.flatten()
        # The sum over real characters and their count: the trainer divides the step's gradients
        # by the count over all its microsteps, so padding and uneven batches weigh nothing.
        return Loss((losses * mask).sum(), mask.sum()), {}

    @torch.no_grad()
    def bits_per_char(self, model: nn.Module) -> float:
        """``model``'s mean loss on the held-out text, in bits per character."""
        inputs, targets, mask = (t.to(self.device) for t in self.val_batch)
        with eval_mode(model), self.autocast():
            logits = model(inputs)
        losses = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none")
        mask = mask.flatten()
        return ((losses * mask).sum() / mask.sum()).item() / math.log(2)

    def val_metrics(self) -> dict[str, float]:
        """The training model's validation bits per character (the ValidationHook calls it)."""
        bpc = self.bits_per_char(self.model)
        self.logger.info("Step %d: validation %.3f bits per character", self.step, bpc)
        return {"bpc": bpc}

    @torch.no_grad()
    def sample(self, model: nn.Module) -> str:
        """Continue ``settings.prompt`` by ``settings.sample_length`` characters."""
        s = self.settings
        generator = torch.Generator(device=self.device).manual_seed(s.seed or 0)
        ids = self.codec.encode(s.prompt).to(self.device)
        with eval_mode(model), self.autocast():
            for _ in range(s.sample_length):
                logits = model(ids[-s.context :].unsqueeze(0))[0, -1].float()
                if s.temperature == 0:
                    next_id = logits.argmax()
                else:
                    next_id = torch.multinomial(F.softmax(logits / s.temperature, -1), 1, generator=generator)[0]
                ids = torch.cat([ids, next_id.view(1)])
        return self.codec.decode(ids[len(s.prompt) :].cpu())

    def ema_model(self) -> nn.Module | None:
        """The EmaHook's averaged model, or ``None`` when the settings declare no ``ema`` hook."""
        return next((h.ema_model for h in self.hooks if isinstance(h, EmaHook)), None)


def main(argv: list[str]) -> float:
    """Train from a settings file, print a sample and return the validation bits per character
    of the EMA model (of the trained model when there is no ``ema`` hook)."""
    path = Path(argv[0]) if argv else Path(__file__).with_name("settings.json")
    trainer = CharLMTrainer(CharLMSettings.from_file(path))
    trainer.train()
    ema = trainer.ema_model()
    model, name = (trainer.model, "model") if ema is None else (ema, "EMA model")
    bpc = trainer.bits_per_char(model)
    print(f"sample ({name}): {trainer.settings.prompt}{trainer.sample(model)}")
    print(
        f"validation {bpc:.3f} bits per character after {trainer.step} steps "
        f"(uniform over {len(trainer.codec)} characters: {math.log2(len(trainer.codec)):.3f})"
    )
    return bpc


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    main(sys.argv[1:])
