"""Exact save and resume of a whole training run, and export of its true weights.

* `save` / `load`: model, optimizer (masters and moments in their own
  representation), `Precision` (loss scaler, telemetry), step, RNG states and the
  policy, written with `torch.distributed.checkpoint` into a directory that is
  renamed into place only when complete, with a checksum per file.
* `export`: consolidated safetensors with the model's own key names, taken from
  the optimizer's master where there is one.

See docs/checkpoint.md.
"""

from __future__ import annotations

from mixprec.checkpoint.export import export
from mixprec.checkpoint.layout import (
    CheckpointError,
    CheckpointInfo,
    CheckpointWarning,
    list_checkpoints,
    resolve,
    verify,
)
from mixprec.checkpoint.loading import load
from mixprec.checkpoint.saving import save

__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointWarning",
    "export",
    "list_checkpoints",
    "load",
    "resolve",
    "save",
    "verify",
]
