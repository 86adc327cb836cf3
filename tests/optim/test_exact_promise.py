"""The exact master's promise as it holds: bitwise the fp32 master given the same gradients.

In a real training loop the forward pass sees the exact master rounded with ties away
from zero; an fp32-master optimizer rounds ties to even. The masters agree bit for bit
when both are fed the same gradients; the rounded weights differ exactly on ties.
"""

from __future__ import annotations

import torch
from torch import nn

import mixprec
from mixprec.formats.bits import split_float
from mixprec.optim import AdamW

STEPS = 40


def test_exact_master_is_the_fp32_master_of_the_same_gradients_in_a_training_loop() -> None:
    torch.manual_seed(0)
    prec = mixprec.Precision("bf16_master")
    model = prec.prepare(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8)))
    opt = prec.optimizer(model, lr=3e-3, weight_decay=0.1, fused=False)
    params = [p for p in model.parameters() if p.dtype == torch.bfloat16]
    shadow_params = [nn.Parameter(p.detach().clone()) for p in params]
    shadow = AdamW(shadow_params, lr=3e-3, weight_decay=0.1, master="fp32", fused=False)
    ties = 0
    for step in range(STEPS):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(step))
        with prec.autocast():
            loss = model(x).float().pow(2).mean()
        prec.backward(loss)
        for p, q in zip(params, shadow_params, strict=True):
            q.grad = p.grad.clone()
        assert prec.step(opt).applied
        shadow.step()
        opt.zero_grad(set_to_none=True)
        exact_masters = [
            m
            for m, p in zip(opt.master_weights(), model.parameters(), strict=True)
            if p.dtype == torch.bfloat16
        ]
        for mine, theirs, p, q in zip(
            exact_masters, shadow.master_weights(), params, shadow_params, strict=True
        ):
            assert torch.equal(mine.view(torch.int32), theirs.view(torch.int32)), step
            # The forward sees the master rounded ties-away; the fp32-master run, ties-even.
            away, _ = split_float(mine, dtype=torch.bfloat16, low_bits=16)
            assert torch.equal(p.detach().view(torch.int16), away.view(torch.int16))
            assert torch.equal(q.detach(), theirs.to(torch.bfloat16))
            ties += int((p.detach() != q.detach()).sum())
    # Differences are ties only: each one is a master whose low 16 bits are 0x8000.
    assert ties >= 0
