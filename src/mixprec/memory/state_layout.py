"""Bytes a `mixprec.optim` optimizer keeps per parameter tensor, from the formats' registry.

This is the analytic side of optimizer state: `estimate` reads it, and `measure`
walks the real state tensors instead (`mixprec.memory.measurement`), so the two are
separate witnesses of the same numbers.
"""

from __future__ import annotations

import torch

from mixprec.formats import master_spec, moment_format, moment_spec
from mixprec.formats.moments import Int4Moments
from mixprec.formats.spec import ADAM_MOMENTS
from mixprec.optim.sharding import int8_shards_fit

__all__ = ["INT8_BLOCK_SIZE", "INT8_MIN_NUMEL", "int8_eligible", "state_nbytes"]

#: `mixprec.optim.AdamW` defaults for int8 moments: elements per quantization block,
#: and the smallest tensor quantized (smaller ones, and tensors whose size is not a
#: multiple of the block, keep fp32 moments). A test pins these to the optimizer's.
INT8_BLOCK_SIZE = 256
INT8_MIN_NUMEL = 4096


def state_nbytes(
    numel: int,
    *,
    param_dtype: torch.dtype,
    master: str,
    moments: str,
    block_size: int = INT8_BLOCK_SIZE,
    min_int8_numel: int = INT8_MIN_NUMEL,
    quantizable: bool | None = None,
    slots: tuple[tuple[str, str], ...] = ADAM_MOMENTS,
    shape: tuple[int, ...] | None = None,
) -> dict[str, int]:
    """Bytes a `mixprec.optim` optimizer keeps for one parameter tensor, by category.

    `slots` are the moments its update rule keeps (`mixprec.optim.rules.Rule.slots`:
    AdamW's two by default, one for SGD with momentum and Lion, three with AMSGrad,
    none for plain SGD), each stored in the `moments` format.

    The bytes come from the formats' declared layouts (`mixprec.formats` specs),
    not from the tensors the optimizer makes, so `estimate` and `measure` are two
    separate witnesses (a test checks the specs against real state). Step counters
    and RNG state are not counted.
    `quantizable` overrides the int8 eligibility rule (for aggregate counts, which
    stand for many large tensors). `shape`, where known, applies int4's own rule
    (`Int4Moments.fits`; a tensor it does not fit gets int8 moments where int8's rule
    allows, else fp32, as the optimizer plans) and sizes its per-row and per-column
    statistics (else a square matrix is assumed).
    """
    master_bytes = master_spec(master).nbytes(numel)
    spec = moment_spec(moments)
    if spec.name == "int4":  # int4 where it fits, else int8 where that fits, else fp32
        if shape is not None:
            fits = numel >= min_int8_numel and Int4Moments.fits(shape)
        else:
            fits = numel >= min_int8_numel if quantizable is None else quantizable
        if not fits:
            spec = moment_spec("int8")
    if spec.blockwise and spec.name != "int4":
        if quantizable is None:
            quantizable = numel >= min_int8_numel and numel % block_size == 0
        if not quantizable:  # the optimizer keeps fp32 moments for such tensors
            spec = moment_spec("fp32")
    rows = shape[0] if shape is not None and len(shape) >= 2 else None
    moment_bytes = spec.nbytes(numel, block_size=block_size, slots=slots, rows=rows)
    del param_dtype  # the layout does not depend on it beyond the master choice
    return {"master": master_bytes, "moments": moment_bytes}


def int8_eligible(
    shape: tuple[int, ...],
    *,
    parts: int = 1,
    block_size: int = INT8_BLOCK_SIZE,
    min_int8_numel: int = INT8_MIN_NUMEL,
) -> bool:
    """Whether `mixprec.optim.AdamW` keeps int8 moments for a parameter of `shape`
    sharded on dim 0 over `parts` ranks (FSDP2), as its planner decides: the whole
    parameter has at least `min_int8_numel` elements and whole blocks, and every
    shard holds whole blocks (`mixprec.optim.sharding.int8_shards_fit`); otherwise
    it keeps fp32 moments on every rank."""
    numel = 1
    for size in shape:
        numel *= size
    if numel < min_int8_numel or numel % block_size:
        return False
    scale_shape = moment_format("int8", block_size=block_size).scale_shape(shape)  # type: ignore[attr-defined]
    return int8_shards_fit(shape, block_size, scale_shape, parts)
