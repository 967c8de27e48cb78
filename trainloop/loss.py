"""A loss given as a sum over items, so accumulation can normalise by the true item count."""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["Loss"]


class Loss(NamedTuple):
    """A loss summed over ``count`` items (tokens, pixels, samples), returned by ``forward``.

    With variable-size microbatches a per-microbatch mean weighs items unequally. Returning
    ``Loss(sum, count)`` instead makes the trainer divide the step's gradients by the total count
    over all its microsteps (and over all ranks of a DDP/FSDP model), so the step follows the
    gradient of the mean over every item, exactly as one big batch would::

        def forward(self, batch):
            logits = self.model(batch["tokens"])
            losses = F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten(), reduction="none")
            mask = batch["mask"].flatten()
            return Loss((losses * mask).sum(), mask.sum()), {}

    Attributes:
        sum: The scalar sum of the items' losses (what is backpropagated).
        count: How many items it covers (an int or a scalar tensor; a tensor stays on the device).
    """

    sum: torch.Tensor
    # The field shadows tuple.count(), which mypy rejects; ``count`` is the public name users write.
    count: torch.Tensor | int  # type: ignore[assignment]
