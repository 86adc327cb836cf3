"""Bytes saved for backward, predicted on fake tensors, against closed forms."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mixprec.memory import saved_activation_bytes


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        # fp32: the input (2x8) and the hidden output (2x16) in fp32; weights are parameters.
        ("fp32", 2 * 8 * 4 + 2 * 16 * 4),
        # autocast: both in bf16, plus the bf16 copy autocast makes of the second weight
        # (the first layer's input needs no gradient, so its weight copy is not saved).
        ("amp_bf16", 2 * 8 * 2 + 2 * 16 * 2 + 4 * 16 * 2),
        # bf16 storage: the weights are parameters themselves, nothing is copied.
        ("bf16_master", 2 * 8 * 2 + 2 * 16 * 2),
    ],
)
def test_two_linear_layers(policy: str, expected: int) -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    x = torch.randn(2, 8)
    assert saved_activation_bytes(model, x, policy=policy) == expected


def test_the_model_is_not_changed() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    saved_activation_bytes(model, torch.randn(2, 8), policy="bf16_master")
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32
        assert torch.equal(p, before[name]), name
