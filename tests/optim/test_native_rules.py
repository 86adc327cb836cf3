"""The native kernel steps every update rule bitwise like the eager path (`optim/rules.py`)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest
import torch

from mixprec.optim import MASTER_KINDS, SGD, Adam, AdamW, Lion, native
from mixprec.optim.rule_optimizer import RuleOptimizer
from mixprec.optim.rules import RULES
from mixprec.optim.step_batch import StepBatch, kernel_for

try:
    native.library()
    HAVE_NATIVE, WHY = True, ""
except native.NativeUnavailableError as exc:  # pragma: no cover - machines without a compiler
    HAVE_NATIVE, WHY = False, str(exc)

pytestmark = pytest.mark.skipif(not HAVE_NATIVE, reason=f"native kernel unavailable: {WHY}")

#: Each rule's optimizer, from constructor options (weight decay on, so every term counts).
MAKERS: dict[str, Callable[..., RuleOptimizer]] = {
    "adamw": lambda ps, **kw: AdamW(ps, weight_decay=0.1, **kw),
    "adamw_amsgrad": lambda ps, **kw: AdamW(ps, weight_decay=0.1, amsgrad=True, **kw),
    "adam": lambda ps, **kw: Adam(ps, weight_decay=0.1, **kw),
    "adam_amsgrad": lambda ps, **kw: Adam(ps, weight_decay=0.1, amsgrad=True, **kw),
    "sgd": lambda ps, **kw: SGD(ps, lr=0.1, weight_decay=0.1, **kw),
    "sgd_momentum": lambda ps, **kw: SGD(
        ps, lr=0.1, momentum=0.9, dampening=0.2, weight_decay=0.1, **kw
    ),
    "sgd_nesterov": lambda ps, **kw: SGD(
        ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.1, **kw
    ),
    "lion": lambda ps, **kw: Lion(ps, lr=1e-2, weight_decay=0.1, **kw),
}

# An int8 tail that keeps fp32 moments (not a whole number of 256-blocks), whole int8
# blocks, and a tensor too small for int8.
SHAPES = [(4096 + 13,), (8192,), (3, 7)]
#: Every master with bf16 parameters, and fp32 parameters without one.
PARAM_KINDS = [(master, torch.bfloat16) for master in MASTER_KINDS] + [("none", torch.float32)]
#: A group per master, moment format and maximize: one optimizer covers them all.
GROUP_KINDS = list(itertools.product(PARAM_KINDS, ("fp32", "bf16", "int8"), (False, True)))
STEPS = 4
SKIPPED = 2  # the step at which the first parameter of each group has no gradient


def param_groups(
    seed: int,
    shapes: list[tuple[int, ...]],
    kinds: list[tuple[tuple[str, torch.dtype], str, bool]],
) -> list[dict[str, Any]]:
    """A group of parameters of `shapes` (random, seeded) per ((master, dtype), moments,
    maximize) of `kinds`."""
    gen = torch.Generator().manual_seed(seed)
    return [
        {
            "params": [
                (torch.randn(s, generator=gen) * 2).to(dtype).requires_grad_() for s in shapes
            ],
            "master": master,
            "moments": moments,
            "maximize": maximize,
        }
        for (master, dtype), moments, maximize in kinds
    ]


def _groups(seed: int) -> list[dict[str, Any]]:
    return param_groups(seed, SHAPES, GROUP_KINDS)


def _params(opt: RuleOptimizer) -> list[torch.Tensor]:
    return [p for group in opt.param_groups for p in group["params"]]


def _set_grads(opt: RuleOptimizer, step: int) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    for group in opt.param_groups:
        group["lr"] = group["lr"] * 0.9  # a scheduler: the scalars change each step
        for i, p in enumerate(group["params"]):
            # both gradient dtypes on every tensor, scales from 1e-4 to 1e2
            grad_dtype = (torch.bfloat16, torch.float32)[(step + i) % 2]
            grad = torch.randn(p.shape, generator=gen) * 10.0 ** (2 * (step % 4) - 4)
            grad[..., ::5] = 0.0  # zeros: sign(0) for Lion, an untouched max for AMSGrad
            p.grad_dtype = None  # allow fp32 gradients on bf16 params
            p.grad = None if (step == SKIPPED and i == 0) else grad.to(grad_dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def _snapshot(opt: RuleOptimizer, p: torch.Tensor) -> list[torch.Tensor]:
    return [_bits(p).clone()] + [_bits(v).clone() for v in opt.state[p].values()]


@pytest.mark.parametrize("rule", sorted(RULES))
def test_every_family_of_a_rule_is_bitwise_the_eager_step(rule: str) -> None:
    """Every master x moment format x maximize, both gradient dtypes, int8 blocks and
    tails, a step where a parameter has no gradient (it and its state stay as they are)."""
    kw: dict[str, Any] = {"seed": 5, "block_size": 256}
    eager = MAKERS[rule](_groups(0), fused=False, **kw)
    fast = MAKERS[rule](_groups(0), fused=True, **kw)
    for step in range(STEPS):
        _set_grads(eager, step)
        _set_grads(fast, step)
        skipped = [p for group in fast.param_groups for p in group["params"][:1]]
        before = [_snapshot(fast, p) for p in skipped] if step == SKIPPED else []
        eager.step()
        fast.step()
        for p, saved in zip(skipped, before, strict=False):
            assert all(map(torch.equal, _snapshot(fast, p), saved))
    assert set(fast.kernel_backends().values()) == {"native"}
    int8_keys = 0
    for a, b in zip(_params(eager), _params(fast), strict=True):
        assert torch.equal(_bits(a), _bits(b))
        assert eager.state[a].keys() == fast.state[b].keys()
        for key, value in eager.state[a].items():
            assert value.dtype == fast.state[b][key].dtype, key
            assert torch.equal(_bits(value), _bits(fast.state[b][key])), (key, a.shape)
        int8_keys += sum(key.endswith(("_i8", "_u8")) for key in fast.state[b])
        # the first parameter of each group skipped one step
        expected = STEPS - 1 if a.shape == SHAPES[0] else STEPS
        assert float(fast.state[b]["step"]) == float(eager.state[a]["step"]) == expected
    # the int8 groups really ran int8 (the whole-block tensor) beside their fallback
    assert int8_keys == len(PARAM_KINDS) * 2 * len(RULES[rule].slots)


#: Values for each hyperparameter position: in and out of every rule's range.
PROBES = [float("nan"), float("inf"), -float("inf"), -0.5, 0.0, 0.5, 1.0, 1.5]
BASE = {
    "adam": (1e-3, 0.9, 0.999, 1e-8, 0.01),
    "sgd": (1e-2, 0.9, 0.1, 0.0, 0.01),
    "lion": (1e-3, 0.9, 0.99, 0.0, 0.01),
}


@pytest.mark.parametrize("rule", sorted(RULES))
def test_the_kernel_refuses_exactly_what_rule_valid_refuses(rule: str) -> None:
    """Return code 5 (nothing written) for every hyperparameter `Rule.valid` refuses,
    a step for every one it accepts: each position probed with values in and out of
    range."""
    step_rule = RULES[rule]
    base = next(values for prefix, values in BASE.items() if rule.startswith(prefix))
    kernel = kernel_for(rule, "none", "fp32", maximize=False, block_size=256, mode="native")
    n_moments = len(step_rule.slots)
    p = torch.randn(64)
    grad = torch.randn(64)
    moments = [torch.zeros(64) for _ in range(n_moments)]
    step = torch.zeros((), dtype=torch.float64)
    refused = 0
    for position, value in itertools.product(range(5), PROBES):
        hyper = list(base)
        hyper[position] = value
        batch = StepBatch(
            kernel,
            256,
            params=[p],
            grads=[grad],
            moment_state=moments,
            steps=[step],
            offsets=[0],
        )
        before, count = p.clone(), float(step)
        if step_rule.valid(tuple(hyper)):  # type: ignore[arg-type]
            native.library().step_many(batch, hyper)
            assert float(step) == count + 1
        else:
            refused += 1
            with pytest.raises(ValueError, match=rf"code 5\).*out of range for {rule}"):
                native.library().step_many(batch, hyper)
            assert torch.equal(p, before) and float(step) == count
    assert refused > 0
