"""The native kernel's int4 case (two passes over rows) is bitwise the eager step."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from mixprec.optim import native
from mixprec.optim.rule_optimizer import RuleOptimizer
from mixprec.optim.rules import RULES

from .test_native import assert_native_codes_at_boundaries
from .test_native_rules import MAKERS, PARAM_KINDS, param_groups

try:
    native.library()
    HAVE_NATIVE, WHY = True, ""
except native.NativeUnavailableError as exc:  # pragma: no cover - machines without a compiler
    HAVE_NATIVE, WHY = False, str(exc)

pytestmark = pytest.mark.skipif(not HAVE_NATIVE, reason=f"native kernel unavailable: {WHY}")

# Rows of 256 (16 rows a work item), rows longer than a work item (65 blocks), a 3-D
# parameter (cols 256), and a tensor that keeps fp32 moments.
SHAPES = [(64, 256), (3, 8320), (24, 4, 64), (300,)]
STEPS = 4
SKIPPED = 2  # the step at which the first parameter of each group has no gradient


def _groups(seed: int) -> list[dict[str, Any]]:
    # int4 moments for every kind, maximize in every other group
    kinds = [(kind, "int4", i % 2 == 1) for i, kind in enumerate(PARAM_KINDS)]
    return param_groups(seed, SHAPES, kinds)


def _set_grads(opt: RuleOptimizer, step: int) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    for group in opt.param_groups:
        group["lr"] = group["lr"] * 0.9  # a scheduler: the scalars change each step
        for i, p in enumerate(group["params"]):
            grad_dtype = (torch.bfloat16, torch.float32)[(step + i) % 2]
            grad = torch.randn(p.shape, generator=gen) * 10.0 ** (2 * (step % 4) - 4)
            grad[..., ::5] = 0.0  # zeros: sign(0) for Lion, an untouched max for AMSGrad
            grad.view(grad.shape[0], -1)[1] *= 1e3  # a row of large values
            p.grad_dtype = None  # allow fp32 gradients on bf16 params
            p.grad = None if (step == SKIPPED and i == 0) else grad.to(grad_dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("rule", sorted(RULES))
def test_every_int4_family_of_a_rule_is_bitwise_the_eager_step(rule: str) -> None:
    """Every master, fp32 params, maximize, both gradient dtypes, a skipped parameter,
    on two threads (the column maxima are reduced across them)."""
    eager = MAKERS[rule](_groups(0), fused=False, seed=5)
    fast = MAKERS[rule](_groups(0), fused=True, seed=5)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for step in range(STEPS):
            _set_grads(eager, step)
            _set_grads(fast, step)
            eager.step()
            fast.step()
    finally:
        torch.set_num_threads(threads)
    assert set(fast.kernel_backends().values()) == {"native"}
    int4_keys = 0
    params = [
        (a, b)
        for ga, gb in zip(eager.param_groups, fast.param_groups, strict=True)
        for a, b in zip(ga["params"], gb["params"], strict=True)
    ]
    for a, b in params:
        assert torch.equal(_bits(a), _bits(b))
        assert eager.state[a].keys() == fast.state[b].keys()
        for key, value in eager.state[a].items():
            assert torch.equal(_bits(value), _bits(fast.state[b][key])), (key, a.shape)
        int4_keys += sum(key.endswith(("_i4", "_u4")) for key in fast.state[b])
        expected = STEPS - 1 if a.shape == SHAPES[0] else STEPS
        assert float(fast.state[b]["step"]) == expected
    # every group's three matrices kept int4 moments (plain SGD keeps none)
    assert int4_keys == len(params) // len(SHAPES) * 3 * len(RULES[rule].slots)


def test_int4_steps_tensors_window_by_window_bitwise_the_eager_step() -> None:
    """Both passes run over windows of about 2**19 elements a thread: a tensor that fills
    one alone between smaller ones grouped in others (one thread)."""
    shapes = [(32, 128), (48, 256), (512, 1024), (40, 384), (16, 128)]
    gen = torch.Generator().manual_seed(0)
    params = [(torch.randn(s, generator=gen) * 2).bfloat16() for s in shapes]
    eager_p = [p.clone().requires_grad_() for p in params]
    fast_p = [p.clone().requires_grad_() for p in params]
    kw: dict[str, Any] = {"master": "remainder8", "moments": "int4"}
    eager = MAKERS["adamw"](eager_p, fused=False, **kw)
    fast = MAKERS["adamw"](fast_p, fused=True, **kw)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for step in range(2):
            gen = torch.Generator().manual_seed(100 + step)
            for a, b in zip(eager_p, fast_p, strict=True):
                a.grad = (torch.randn(a.shape, generator=gen) * 1e-2).bfloat16()
                b.grad = a.grad.clone()
            eager.step()
            fast.step()
    finally:
        torch.set_num_threads(threads)
    assert set(fast.kernel_backends().values()) == {"native"}
    for a, b in zip(eager_p, fast_p, strict=True):
        assert torch.equal(_bits(a), _bits(b))
        for key, value in eager.state[a].items():
            assert torch.equal(_bits(value), _bits(fast.state[b][key])), (key, a.shape)


CODES_CHECK = Path(__file__).with_name("native_codes_check.cpp")


@pytest.mark.slow
def test_the_avx512_codes_are_the_scalar_codes_on_every_float(tmp_path: Path) -> None:
    """The fast loops code int8 and int4 moments from root estimates and magic sums:
    every float of their ranges (the tiny ones sampled) must code as the scalar
    functions do (native_codes_check.cpp, built with the kernel's flags)."""
    flags = [f for f in native.build.flag_sets()[0] if f not in ("-shared", "-fPIC", "-O3")]
    exe = tmp_path / "check"
    source = native.build.SOURCE
    compiler = native.build._compiler()  # $CXX, as the library
    subprocess.run(
        [compiler, *flags, "-O1", f"-I{source.parent}", str(CODES_CHECK), "-o", str(exe)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    env = {**os.environ, "OMP_NUM_THREADS": str(os.cpu_count() or 1)}  # it splits its ranges
    run = subprocess.run(
        [str(exe)], capture_output=True, text=True, timeout=300, check=False, env=env
    )
    if run.returncode == 2:
        pytest.skip(run.stdout.strip())
    assert run.returncode == 0, run.stdout
    assert run.stdout.endswith(" 0 differ\n")


def _near_int4_boundaries(rows: int, gen: torch.Generator) -> torch.Tensor:
    """Rows of 256 gradients whose first-step moments land within a few ulps of an int4
    code's rounding boundary: element 0 of each block of 128 and of each column (on row
    `column % rows`) is 1.0, the largest, so the signed code is rint(7 * sqrt(|g|)) and the
    square code rint(16 * g**2) - 1; each other element sits near one of either (chosen
    at random), nudged by -8..8 ulps, with a random sign."""
    cols = 256
    k_signed = torch.randint(0, 7, (rows, cols), generator=gen).double()
    signed = ((k_signed + 0.5) / 7) ** 2
    k_square = torch.randint(0, 16, (rows, cols), generator=gen).double()
    square = ((k_square + 0.5) / 16) ** 0.5
    value = torch.where(torch.rand(rows, cols, generator=gen) < 0.5, signed, square)
    ulps = torch.randint(-8, 9, (rows, cols), generator=gen).double()
    grads = (value * (1.0 + ulps * 2.0**-23)).float()
    grads = grads * (torch.randint(0, 2, (rows, cols), generator=gen) * 2 - 1)
    grads[:, ::128] = 1.0
    grads[torch.arange(cols) % rows, torch.arange(cols)] = 1.0
    return grads


@pytest.mark.parametrize("maximize", [False, True])
def test_int4_codes_are_bitwise_eager_at_their_rounding_boundaries(maximize: bool) -> None:
    """The AVX-512 int4 loop rounds the signed codes' roots from an estimate (rsqrt14, no
    Newton step) and the square codes by a magic sum: moments a few ulps from every code
    boundary, rows that never move (maxima of 0) and squares that underflow to subnormals
    (an infinite factor) give eager's codes and parameters, bitwise."""
    gen = torch.Generator().manual_seed(11)
    assert_native_codes_at_boundaries(_near_int4_boundaries(48, gen), "int4", maximize, gen)
