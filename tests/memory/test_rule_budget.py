"""The budget counts the moments each update rule keeps (issue 34, "Memory"): measured
on a real model after a few steps, per component, for SGD with momentum over bf16
with an exact master and bf16 gradients, plain SGD, Adam with AMSGrad and int8
moments, Lion with bf16 moments and AdamW in fp32, against `estimate`'s prediction."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

import mixprec.optim
from mixprec import Precision
from mixprec.engine.optimizers import implied_param_groups
from mixprec.islands import island_param_ids
from mixprec.memory import estimate, measure, optimizer_rule, optimizer_state_bytes, state_nbytes
from mixprec.optim.rules import RULES
from mixprec.policy import preset

from .gpt import gpt_and_batch

#: (case, policy, moments, optimizer class, its arguments, the rule they pick).
CASES = [
    ("sgd_momentum_exact", "bf16_master", "fp32", "SGD", {"momentum": 0.9}, "sgd_momentum"),
    ("sgd_plain_exact", "bf16_master", "fp32", "SGD", {}, "sgd"),
    ("adam_amsgrad_int8", "bf16_master", "int8", "Adam", {"amsgrad": True}, "adam_amsgrad"),
    ("lion_bf16", "bf16_master", "bf16", "Lion", {}, "lion"),
    ("adamw_fp32", "fp32", "fp32", "AdamW", {}, "adamw"),
]

COMPONENTS = ("params", "fp32_islands", "grads", "master", "moments")


@pytest.mark.parametrize(
    ("policy", "moments", "cls", "args", "rule"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_measured_equals_the_budget_per_component(
    policy: str, moments: str, cls: str, args: dict[str, Any], rule: str
) -> None:
    wl, model, x, y = gpt_and_batch()
    pol = dataclasses.replace(preset(policy), moments=moments)
    prec = Precision(pol)
    prec.prepare(model)
    groups = implied_param_groups(prec.plan, model, islands=island_param_ids(model))
    opt = getattr(mixprec.optim, cls)(groups, lr=1e-4, moments=moments, **args)
    name = cls.lower()
    predicted = estimate(
        model, pol, inputs=x, loss_fn=wl.loss, targets=y, optimizer=name, optimizer_args=args
    )  # type: ignore[attr-defined]
    assert predicted.rule == rule

    def step() -> None:
        with prec.autocast():
            out = model(x)
        wl.loss(out, y).backward()  # type: ignore[attr-defined]
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):  # a few steps before the measured one: the state is made once
        step()
    got = measure(model, opt, step, policy=pol)
    for comp in COMPONENTS:
        assert getattr(got.bytes, comp) == getattr(predicted.bytes, comp), comp
    # what is left is each parameter's step counter (one float64), nothing unnamed
    steps = sum(1 for s in opt.state.values() if "step" in s)
    assert optimizer_state_bytes(opt)["other"] == 8 * steps


@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize("moments", ["fp32", "bf16", "int8"])
def test_every_rules_moments_are_measured_as_moments(rule: str, moments: str) -> None:
    """Found here: AMSGrad's int8 maximum and SGD's int8 momentum buffer were counted as
    ``other`` (their keys were not the registry's AdamW keys)."""
    n = 1 << 13
    p = torch.zeros(n, dtype=torch.bfloat16, requires_grad=True)
    p.grad = torch.full_like(p, 1e-3)
    cls, args = {
        "adamw": ("AdamW", {}),
        "adamw_amsgrad": ("AdamW", {"amsgrad": True}),
        "adam": ("Adam", {}),
        "adam_amsgrad": ("Adam", {"amsgrad": True}),
        "sgd": ("SGD", {}),
        "sgd_momentum": ("SGD", {"momentum": 0.9}),
        "sgd_nesterov": ("SGD", {"momentum": 0.9, "nesterov": True}),
        "lion": ("Lion", {}),
    }[rule]
    opt = getattr(mixprec.optim, cls)([p], master="exact", moments=moments, **args)
    assert optimizer_rule(cls.lower(), args) == rule
    opt.step()
    got = optimizer_state_bytes(opt)
    want = state_nbytes(
        n, param_dtype=torch.bfloat16, master="exact", moments=moments, slots=RULES[rule].slots
    )
    assert (got["master"], got["moments"], got["other"]) == (want["master"], want["moments"], 8)


def test_bad_optimizer_names_and_arguments_are_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"unknown optimizer 'muon'; valid: adamw, adam, sgd"):
        optimizer_rule("muon")
    with pytest.raises(
        ValueError, match=r"optimizer 'sgd' takes no argument 'momentun'; valid: .*momentum"
    ):
        optimizer_rule("sgd", {"momentun": 0.9})
    with pytest.raises(ValueError, match=r"'moments': the policy decides"):
        optimizer_rule("lion", {"moments": "bf16"})
    with pytest.raises(ValueError, match=r"[Nn]esterov"):
        optimizer_rule("sgd", {"nesterov": True})  # torch's own check: needs a momentum


def test_a_wrappers_inner_optimizer_state_is_counted() -> None:
    """``mixprec.optim.Mastered`` keeps the masters in its own state and the torch
    optimizer it steps (``inner``) keeps that optimizer's state: both are counted."""
    n = 1 << 12
    p = torch.zeros(n, requires_grad=True)
    p.grad = torch.ones_like(p)
    inner = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    inner.step()

    class Wrapper(torch.optim.Optimizer):  # what Mastered exposes, by attribute
        def __init__(self) -> None:
            super().__init__([torch.zeros(1)], {})
            self.inner = inner

    got = optimizer_state_bytes(Wrapper())
    assert got["moments"] == 4 * n  # the momentum buffer, fp32
