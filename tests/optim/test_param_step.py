"""`RuleOptimizer.step_param`: one parameter stepped alone, bitwise as `step` steps it."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch

from mixprec.optim import SGD, AdamW, Lion
from mixprec.optim.rule_optimizer import RuleOptimizer

Build = Callable[[list[torch.nn.Parameter]], RuleOptimizer]

CASES: dict[str, Build] = {
    "adamw-exact-fp32": lambda ps: AdamW(ps, lr=1e-2, master="exact", weight_decay=0.1),
    "adamw-remainder8-int8": lambda ps: AdamW(
        ps, lr=1e-2, master="remainder8", moments="int8", min_int8_numel=256
    ),
    "adamw-stochastic-eager": lambda ps: AdamW(ps, lr=1e-2, master="stochastic", fused=False),
    "sgd-momentum-kahan": lambda ps: SGD(ps, lr=1e-2, momentum=0.9, master="kahan"),
    "lion-exact": lambda ps: Lion(ps, lr=1e-3, master="exact"),
}


def _params() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    shapes = [(64, 32), (64,), (32, 64), (32,)]
    params = [torch.nn.Parameter(torch.randn(s).bfloat16()) for s in shapes]
    return [*params, torch.nn.Parameter(torch.randn(16))]  # an fp32 parameter


def _grads(params: list[torch.nn.Parameter], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=gen).to(p.dtype) for p in params]


def _same(a: RuleOptimizer, b: RuleOptimizer, pa: list, pb: list) -> None:
    for x, y in zip(pa, pb, strict=True):
        assert torch.equal(x, y)
    for x, y in zip(a.master_weights(), b.master_weights(), strict=True):
        assert torch.equal(x, y)
    sa, sb = a.state_dict()["state"], b.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for key in sa:
        for name, value in sa[key].items():
            assert torch.equal(value, sb[key][name]), (key, name)


@pytest.mark.parametrize("case", sorted(CASES))
def test_step_param_is_bitwise_the_batched_step(case: str) -> None:
    params = _params()
    released = [torch.nn.Parameter(p.detach().clone()) for p in params]
    batched, alone = CASES[case](params), CASES[case](released)
    for step in range(4):
        grads = _grads(params, step)
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        batched.step()
        for q, g in reversed(list(zip(released, grads, strict=True))):  # backward's order
            q.grad = g.clone()
            alone.step_param(q)
            q.grad = None
        if step == 1:  # an in-place edit between steps: the one edit rule, on both paths
            with torch.no_grad():
                params[0].mul_(0.5)
                released[0].mul_(0.5)
        if step == 2:  # a boundary: state loaded again
            alone.load_state_dict(copy.deepcopy(alone.state_dict()))
            batched.load_state_dict(copy.deepcopy(batched.state_dict()))
        _same(batched, alone, params, released)


def test_step_param_after_a_batched_step_keeps_the_master() -> None:
    """A released step after an ordinary one is no edit: the master keeps its low bits."""
    params = _params()
    released = [torch.nn.Parameter(p.detach().clone()) for p in params]
    batched, mixed = CASES["adamw-exact-fp32"](params), CASES["adamw-exact-fp32"](released)
    for step in range(3):
        grads = _grads(params, step)
        for p, q, g in zip(params, released, grads, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        batched.step()
        if step == 1:
            for q in released:
                mixed.step_param(q)
                q.grad = None
        else:
            mixed.step()
        _same(batched, mixed, params, released)


def test_step_param_refuses_a_parameter_it_does_not_hold() -> None:
    opt = AdamW(_params(), lr=1e-2)
    stranger = torch.nn.Parameter(torch.zeros(3))
    stranger.grad = torch.ones(3)
    with pytest.raises(KeyError, match="not in this optimizer"):
        opt.step_param(stranger)
