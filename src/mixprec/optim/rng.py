"""Counter-based random bits for stochastic rounding, identical eager and compiled.

The noise for element ``i`` of a parameter at step ``t`` is a hash of
``(seed, t, i)``: no generator state to carry, nothing allocated, and the same
numbers after a save and reload (seed and step live in the optimizer state).
The mixer is the two-round xorshift-multiply hash found by Chris Wellons'
hash prospector ("lowbias32" family), evaluated in int64 with 31-bit
multipliers so that no signed overflow happens in any backend.
"""

from __future__ import annotations

import torch

__all__ = ["derive_seed", "mix32", "step_key", "uniform16"]

_MASK32 = 0xFFFFFFFF


def mix32(x: torch.Tensor) -> torch.Tensor:
    """Hash int64 values in ``[0, 2**32)`` to int64 values in ``[0, 2**32)``."""
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _MASK32
    return x ^ (x >> 15)


def step_key(seed: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """A per-(parameter, step) key from an int64 seed and the step count (an exact float64
    or integer tensor: a float32 count stops changing at 2**24)."""
    t = step.to(torch.int64) & _MASK32
    return mix32((mix32(t) + seed) & _MASK32)


def uniform16(shape: torch.Size | tuple[int, ...], key: torch.Tensor) -> torch.Tensor:
    """Hashed integers uniform in ``[0, 65536)`` (int64), one per element of `shape`.

    Element ``i`` in row-major order gets ``mix32(i + key) >> 16``.
    """
    numel = 1
    for size in shape:
        numel = numel * size
    index = torch.arange(numel, dtype=torch.int64, device=key.device).view(shape)
    return mix32((index + key) & _MASK32) >> 16


def derive_seed(base_seed: int, index: int) -> int:
    """The seed of parameter ``index`` (in optimizer order) from an optimizer seed."""
    x = torch.tensor([(base_seed + 0x9E3779B9 * (index + 1)) & _MASK32], dtype=torch.int64)
    return int(mix32(x).item())
