"""Each update rule's promises: an ``exact`` master over bf16 parameters is bitwise the
same rule on fp32 parameters (eager and with the default ``fused=None``), and Lion is
the paper's update (Chen et al. 2023) within fp32 rounding of a float64 reference."""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch

import tolerances as tol
from mixprec.optim import SGD, Adam, AdamW, Lion
from mixprec.optim.rule_optimizer import RuleOptimizer

Make = Callable[..., RuleOptimizer]

#: One constructor per update rule (`mixprec.optim.rules`), options that exercise it.
RULES: dict[str, Make] = {
    "adamw": functools.partial(AdamW, lr=1e-2, weight_decay=0.1),
    "adamw_amsgrad": functools.partial(AdamW, lr=1e-2, weight_decay=0.1, amsgrad=True),
    "adam": functools.partial(Adam, lr=1e-2, weight_decay=0.1),
    "adam_amsgrad": functools.partial(Adam, lr=1e-2, weight_decay=0.1, amsgrad=True),
    "sgd": functools.partial(SGD, lr=1e-2, weight_decay=0.1),
    "sgd_momentum": functools.partial(SGD, lr=1e-2, momentum=0.9, dampening=0.2),
    "sgd_nesterov": functools.partial(SGD, lr=1e-2, momentum=0.9, nesterov=True),
    "lion": functools.partial(Lion, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.5),
}
SHAPES = [(64, 33), (33,), (7, 1)]
STEPS = 12


def _values(seed: int) -> list[torch.Tensor]:
    """bf16-representable fp32 values (both runs start from, and are fed, the same)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).bfloat16().float() for s in SHAPES]


def _set_grads(params: list[torch.nn.Parameter], step: int) -> None:
    """bf16-representable gradients, in each parameter's dtype (the same values)."""
    scale = 0.1 if step % 4 == 3 else 1.0  # now and then smaller: AMSGrad's maximum holds
    for p, g in zip(params, _values(100 + step), strict=True):
        p.grad = (g * scale).bfloat16().to(p.dtype)


@pytest.mark.parametrize("fused", [False, None], ids=["eager", "default"])
@pytest.mark.parametrize("name", list(RULES))
def test_an_exact_master_is_bitwise_the_same_rule_on_fp32_parameters(
    name: str, fused: bool | None
) -> None:
    make = RULES[name]
    start = _values(0)
    ref_p = [torch.nn.Parameter(v.clone()) for v in start]
    exact_p = [torch.nn.Parameter(v.bfloat16()) for v in start]
    ref = make(ref_p, fused=fused)
    exact = make(exact_p, master="exact", fused=fused)
    assert exact.rule_of(exact.param_groups[0]).name == name
    for step in range(STEPS):
        for opt, params in ((ref, ref_p), (exact, exact_p)):
            _set_grads(params, step)
            opt.step()
    for master, p in zip(exact.master_weights(), ref_p, strict=True):
        assert torch.equal(master.view(torch.int32), p.detach().view(torch.int32))
    for p, q in zip(exact_p, ref_p, strict=True):  # the stored bf16 is the master rounded
        assert torch.equal(p.detach(), q.detach().bfloat16())


def _lion_reference(
    p: torch.Tensor, grads: list[torch.Tensor], lr: float, betas: tuple[float, float], wd: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lion as the paper writes it, in float64 (its Program 1)."""
    beta1, beta2 = betas
    p, m = p.double(), torch.zeros_like(p, dtype=torch.float64)
    for g in map(torch.Tensor.double, grads):
        c = beta1 * m + (1 - beta1) * g
        p = p * (1 - lr * wd) - lr * torch.sign(c)
        m = beta2 * m + (1 - beta2) * g
    return p, m


@pytest.mark.parametrize("fused", [False, None], ids=["eager", "default"])
def test_lion_is_the_papers_update_within_fp32_rounding(fused: bool | None) -> None:
    lr, betas, wd = 1e-3, (0.9, 0.99), 0.5
    start = _values(0)
    params = [torch.nn.Parameter(v.clone()) for v in start]
    opt = Lion(params, lr=lr, betas=betas, weight_decay=wd, fused=fused)
    grads: list[list[torch.Tensor]] = [[] for _ in params]
    for step in range(STEPS):
        _set_grads(params, step)
        for i, p in enumerate(params):
            assert p.grad is not None
            grads[i].append(p.grad.clone())
        opt.step()
    for i, p in enumerate(params):
        ref_p, ref_m = _lion_reference(start[i], grads[i], lr, betas, wd)
        rel = STEPS * tol.LION_FP64_STEP_REL
        assert bool(((p.detach().double() - ref_p).abs() <= rel * (ref_p.abs() + lr)).all())
        g_max = max(float(g.abs().max()) for g in grads[i])
        m = opt.state[p]["exp_avg"].double()
        assert bool(((m - ref_m).abs() <= rel * (ref_m.abs() + g_max)).all())
