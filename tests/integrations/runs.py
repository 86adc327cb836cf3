"""What the trainer integration tests share: the run they compare (a narrow tiny Llama,
a policy with a loss scale that overflows early, a schedule, a poisoned batch) and
how they compare it (bitwise losses, bitwise state). No trainer is imported here."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

import mixprec
from hf_models import tiny_llama

LR = 3e-3


def policy(name: str) -> mixprec.Policy:
    """The preset; a loss-scaling one starts at 2**24 and grows every 3 steps, so that
    overflowing steps are skipped early on."""
    base = mixprec.preset(name)
    if base.loss_scaling is None:
        return base
    scaling = mixprec.LossScaling(init_scale=2.0**24, growth_interval=3)
    return base.replace(loss_scaling=scaling)


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    # narrower than tiny_llama's default, so that 40 steps take about a second
    return tiny_llama(
        hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1
    )


def schedule(step: int) -> float:
    return min(1.0, (step + 1) / 5) * 0.5 ** (step / 20)


class Poison:
    """A forward hook on the embedding that turns its output NaN for the given batches."""

    def __init__(self, poisoned: Sequence[torch.Tensor]) -> None:
        self.poisoned = list(poisoned)

    def __call__(self, _module: Any, inputs: Any, out: torch.Tensor) -> torch.Tensor:
        hit = any(torch.equal(inputs[0], b) for b in self.poisoned)
        return out * float("nan") if hit else out


def bitwise(a: list[float], b: list[float]) -> bool:
    """Losses equal bit for bit (NaN equal to NaN)."""
    return all((x == y) or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b, strict=True))


def same_state(a: Any, b: Any) -> bool:
    """True when `a` and `b` hold the same structure and bitwise the same tensors."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and torch.equal(a, b)
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)
