"""Seeding, and capturing and restoring the random number generators for an exact resume."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["get_rng_state", "rng_kept", "seed_all", "set_rng_state"]


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:  # NumPy is optional
        return None
    return numpy


def seed_all(seed: int) -> None:
    """Seed Python's ``random``, NumPy's global generator and torch's (CPU and every CUDA device) with ``seed``.

    NumPy's is seeded if NumPy is installed.
    """
    random.seed(seed)
    numpy = _numpy()
    if numpy is not None:
        numpy.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device


def get_rng_state() -> dict[str, Any]:
    """This process's generator states, made of tensors, ints and tuples only.

    The form loads with ``torch.load(weights_only=True)``: NumPy's key array is kept as a tensor.
    """
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"python": (version, internal, gauss), "torch": torch.get_rng_state()}
    numpy = _numpy()
    if numpy is not None:
        name, keys, pos, has_gauss, cached = numpy.random.get_state()
        state["numpy"] = (name, torch.from_numpy(keys.astype("int64")), pos, has_gauss, cached)
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what ``get_rng_state`` returned (parts this process lacks are skipped)."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    numpy = _numpy()
    if numpy is not None and "numpy" in state:
        name, keys, pos, has_gauss, cached = state["numpy"]
        numpy.random.set_state((name, keys.numpy().astype("uint32"), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@contextlib.contextmanager
def rng_kept() -> Iterator[None]:
    """Give the generators ``get_rng_state`` covers back their states after the block, also when it raises.

    What the block draws (a validation loader's base seed, a sampled evaluation) then stays off the stream the
    training draws from, so a run that validates at other steps (a resumed one) draws the same numbers.
    """
    state = get_rng_state()
    try:
        yield
    finally:
        set_rng_state(state)
