"""Channels-last (and other dense non-contiguous) parameters step like torch's AdamW."""

from __future__ import annotations

import io

import pytest
import torch

from mixprec.optim import AdamW

TOLERANCE = 1e-6


def _conv_pair(dtype: torch.dtype) -> tuple[torch.nn.Parameter, torch.nn.Parameter]:
    torch.manual_seed(0)
    w = torch.randn(8, 4, 3, 3).to(dtype)
    a = torch.nn.Parameter(w.clone().to(memory_format=torch.channels_last))
    b = torch.nn.Parameter(w.clone())
    return a, b


@pytest.mark.parametrize("fused", [False, None, True])
def test_a_channels_last_parameter_steps_like_torch(fused: bool | None) -> None:
    """Found by review: channels-last parameters were refused (torch accepts them)."""
    a, b = _conv_pair(torch.float32)
    assert not a.is_contiguous()
    ours, ref = AdamW([a], lr=1e-2, fused=fused), torch.optim.AdamW([b], lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        g = torch.randn(b.shape, generator=gen)
        a.grad = g.clone().to(memory_format=torch.channels_last)
        b.grad = g.clone()
        ours.step()
        ref.step()
    torch.testing.assert_close(a.detach().contiguous(), b.detach(), atol=TOLERANCE, rtol=0)
    assert a.stride() == a.detach().to(memory_format=torch.channels_last).stride()


@pytest.mark.parametrize("master", ["exact", "kahan", "fp32"])
def test_masters_of_channels_last_parameters_match_contiguous_ones(master: str) -> None:
    a, b = _conv_pair(torch.bfloat16)
    ours, theirs = AdamW([a], master=master, fused=False), AdamW([b], master=master, fused=False)
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        g = torch.randn(b.shape, generator=gen).to(torch.bfloat16)
        a.grad = g.clone().contiguous()  # a gradient in another layout is copied to the param's
        b.grad = g.clone()
        ours.step()
        theirs.step()
    assert torch.equal(a.detach().contiguous(), b.detach())
    assert torch.equal(ours.master_weights()[0], theirs.master_weights()[0])
    buf = io.BytesIO()
    torch.save(ours.state_dict(), buf)
    buf.seek(0)
    again = AdamW([torch.nn.Parameter(a.detach().clone())], master=master, fused=False)
    again.load_state_dict(torch.load(buf, weights_only=True))
    assert torch.equal(again.master_weights()[0], ours.master_weights()[0])


def test_tensors_with_gaps_are_refused_naming_the_fix() -> None:
    base = torch.zeros(8, 8)
    gappy = torch.nn.Parameter(base[:, ::2])
    with pytest.raises(ValueError, match=r"gaps or overlaps.*\.contiguous\(\)"):
        AdamW([gappy])
