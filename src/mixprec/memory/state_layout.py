"""Bytes `mixprec.optim.AdamW` keeps per parameter tensor, from the formats' documented layout.

This is the analytic side of optimizer state: `estimate` reads it, and `measure`
walks the real state tensors instead (`mixprec.memory.measurement`), so the two are
separate witnesses of the same numbers.
"""

from __future__ import annotations

import torch

__all__ = ["INT8_BLOCK_SIZE", "INT8_MIN_NUMEL", "state_nbytes"]

#: `mixprec.optim.AdamW` defaults for int8 moments: elements per quantization block,
#: and the smallest tensor quantized (smaller ones, and tensors whose size is not a
#: multiple of the block, keep fp32 moments). A test pins these to the optimizer's.
INT8_BLOCK_SIZE = 256
INT8_MIN_NUMEL = 4096

_MASTER_BYTES_PER_ELEMENT = {
    "none": 0,
    "fp32": 4,  # an fp32 copy
    "exact": 2,  # int16 remainder: bf16 + remainder = the fp32 bits
    "remainder8": 1,  # int8 remainder: a 24-bit master
    "kahan": 2,  # bf16 compensation
    "stochastic": 0,  # rounding noise, no state
}


def state_nbytes(
    numel: int,
    *,
    param_dtype: torch.dtype,
    master: str,
    moments: str,
    block_size: int = INT8_BLOCK_SIZE,
    min_int8_numel: int = INT8_MIN_NUMEL,
    quantizable: bool | None = None,
) -> dict[str, int]:
    """Bytes `mixprec.optim.AdamW` keeps for one parameter tensor, by category.

    The formula is the storage formats' documented layout (docs/optim.md), written
    independently of the optimizer code, so `estimate` and `measure` are two
    separate witnesses. Step counters and RNG state are not counted.
    `quantizable` overrides the int8 eligibility rule (for aggregate counts, which
    stand for many large tensors).
    """
    if master not in _MASTER_BYTES_PER_ELEMENT:
        raise ValueError(
            f"unknown master {master!r}; valid: {', '.join(_MASTER_BYTES_PER_ELEMENT)}"
        )
    master_bytes = numel * _MASTER_BYTES_PER_ELEMENT[master]
    if moments == "fp32":
        moment_bytes = 8 * numel
    elif moments == "bf16":
        moment_bytes = 4 * numel
    elif moments == "int8":
        if quantizable is None:
            quantizable = numel >= min_int8_numel and numel % block_size == 0
        if quantizable:
            blocks = -(-numel // block_size)  # ceil
            # int8 exp_avg + uint8 sqrt-coded exp_avg_sq, one fp32 scale per block each.
            moment_bytes = 2 * numel + 2 * 4 * blocks
        else:
            moment_bytes = 8 * numel
    else:
        raise ValueError(f"unknown moments {moments!r}; valid: fp32, bf16, int8")
    del param_dtype  # the layout does not depend on it beyond the master choice
    return {"master": master_bytes, "moments": moment_bytes}
