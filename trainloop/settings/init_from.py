"""``init_from``: the weights a run starts from when it resumes no checkpoint of its own.

Plain data (no torch): the loading itself is :mod:`trainloop.checkpoint.weights`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from trainloop.settings.types import PathOrUrl, StrictBool

__all__ = ["InitFromSettings"]


class InitFromSettings(BaseModel):
    """Where a fine-tune's weights come from, and how strictly their keys must match the model.

    A plain path is enough (``init_from: runs/pretrain/checkpoints``); the other fields say how
    to read it.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    path: PathOrUrl
    """A trainloop checkpoint directory (full or sharded), a checkpoints root or a workspace
    (its latest checkpoint is used), or a ``.safetensors`` / ``.pt`` state-dict file; a local
    path or an fsspec URL (``s3://bucket/pretrain/checkpoints``)."""
    storage_options: dict[str, Any] | None = None
    """For a URL ``path``: the options of its fsspec filesystem, passed as given
    (``{"endpoint_url": "http://minio:9000"}``), over fsspec's own configuration."""
    weights: str = Field(default="model", min_length=1)
    """From a checkpoint: ``"model"``, ``"ema"`` (the one EMA hook's averaged weights) or the
    name of the hook whose averaged weights to take."""
    strict: StrictBool = True
    """Every key of the model must be loaded and every loaded key used (after ``strip_prefixes``
    and ``ignore``); off: missing and unexpected keys are logged, one line each."""
    strip_prefixes: tuple[str, ...] = ()
    """Prefixes removed from the source's keys before matching (``"_orig_mod."``,
    ``"module."``, ``"transformer."``); the first that matches a key is removed."""
    ignore: tuple[str, ...] = ()
    """Keys (or key prefixes ending in ``.``) neither loaded nor required, on either side: a
    new classification head keeps its initialisation (``"lm_head."``)."""

    @model_validator(mode="before")
    @classmethod
    def _path_alone(cls, value: Any) -> Any:
        # ``init_from: path`` is the common case; it means ``{"path": path}``.
        return {"path": value} if isinstance(value, (str, Path)) else value

    @model_validator(mode="after")
    def _options_need_url(self) -> InitFromSettings:
        if self.storage_options is not None and isinstance(self.path, Path):
            raise ValueError(f"storage_options are for a URL path; {str(self.path)!r} is a local path")
        return self
