"""AdamW: parity with torch, exact-master bitwise claims, format trajectories, checkpoints."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import tolerances as tol
from mixprec.optim import MASTER_KINDS, AdamW

from .checkpoint import reload

SHAPES = [(64, 64), (4096,), (33,)]  # 4096-element params get int8 moments


def _params(dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).to(dtype).requires_grad_() for s in SHAPES]


def _grads(step: int, params: list[torch.Tensor]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(p.shape, generator=gen) * (1 + step % 7) for p in params]


def _run(
    opt: torch.optim.Optimizer,
    params: list[torch.Tensor],
    steps: range,
    on_step: Callable[[int], None] | None = None,
    grad_dtype: torch.dtype | None = None,
) -> None:
    for step in steps:
        for p, g in zip(params, _grads(step, params), strict=True):
            p.grad = g.to(grad_dtype or p.dtype)
        opt.step()
        if on_step is not None:
            on_step(step)


def test_fp32_params_match_torch_adamw_with_schedule() -> None:
    ours, ref = _params(torch.float32), _params(torch.float32)
    opt = AdamW(ours, lr=1e-2, weight_decay=0.1, fused=False)
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.05 * s))
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: 1.0 / (1 + 0.05 * s))
    for step in range(100):
        for p, q, g in zip(ours, ref, _grads(step, ours), strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
        sched.step()
        ref_sched.step()
    for p, q in zip(ours, ref, strict=True):
        rel = ((p - q).abs().max() / q.abs().max()).item()
        assert rel <= tol.TORCH_PARITY_REL


def _nearest_ok(params: list[torch.Tensor], masters: list[torch.Tensor]) -> None:
    for p, m in zip(params, masters, strict=True):
        rne = m.to(torch.bfloat16)
        same = p.view(torch.int16) == rne.view(torch.int16)
        err = (p.double() - m.double()).abs()
        assert bool((same | (err == (rne.double() - m.double()).abs())).all())


def test_exact_master_is_bitwise_the_fp32_master_and_survivesreload() -> None:
    kw: dict[str, object] = {"lr": 1e-2, "weight_decay": 0.1, "fused": False}
    exact_p, fp32_p = _params(torch.bfloat16), _params(torch.bfloat16)
    exact = AdamW(exact_p, master="exact", **kw)  # type: ignore[arg-type]
    ref = AdamW(fp32_p, master="fp32", **kw)  # type: ignore[arg-type]
    _run(ref, fp32_p, range(200))
    ref_master = ref.master_weights()

    _run(exact, exact_p, range(100), lambda s: _nearest_ok(exact_p, exact.master_weights()))
    exact, exact_p = reload(exact, exact_p, master="exact", **kw)
    _run(exact, exact_p, range(100, 200), lambda s: _nearest_ok(exact_p, exact.master_weights()))
    for a, b in zip(exact.master_weights(), ref_master, strict=True):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


COMBOS: list[tuple[str, str]] = [
    (m, mo) for m in MASTER_KINDS if m != "none" for mo in ("fp32", "bf16", "int8")
]
COMBOS += [("none", "fp32"), ("none", "int8")]


@pytest.mark.parametrize(("master", "moments"), COMBOS)
def test_every_combination_reloads_and_continues_bitwise(master: str, moments: str) -> None:
    kw: dict[str, object] = {"lr": 1e-2, "master": master, "moments": moments, "fused": False}
    kw["seed"] = 7
    a_p, b_p = _params(torch.bfloat16), _params(torch.bfloat16)
    a, b = AdamW(a_p, **kw), AdamW(b_p, **kw)  # type: ignore[arg-type]
    _run(a, a_p, range(6))
    _run(b, b_p, range(3))
    b, b_p = reload(b, b_p, **kw)
    _run(b, b_p, range(3, 6))
    for x, y in zip(a_p, b_p, strict=True):
        assert torch.equal(x.view(torch.int16), y.view(torch.int16))
    for x, y in zip(a.master_weights(), b.master_weights(), strict=True):
        assert torch.equal(x, y)


@pytest.mark.parametrize(("master", "moments"), sorted(tol.TRAJECTORY_REL))
def test_format_trajectories_stay_near_the_fp32_master(master: str, moments: str) -> None:
    kw: dict[str, object] = {"lr": 1e-2, "weight_decay": 0.1, "fused": False, "seed": 3}
    ref_p, p = _params(torch.bfloat16), _params(torch.bfloat16)
    init = [q.detach().float() for q in p]
    ref = AdamW(ref_p, master="fp32", **kw)  # type: ignore[arg-type]
    opt = AdamW(p, master=master, moments=moments, **kw)  # type: ignore[arg-type]
    _run(ref, ref_p, range(100))
    _run(opt, p, range(50))
    opt, p = reload(opt, p, master=master, moments=moments, **kw)
    _run(opt, p, range(50, 100))
    for got, want, start in zip(opt.master_weights(), ref.master_weights(), init, strict=True):
        moved = (want - start).abs().max()
        dev = ((got - want).abs().max() / moved).item()
        assert dev <= tol.TRAJECTORY_REL[(master, moments)]


def test_defaults_auto_formats_and_small_int8_fallback() -> None:
    params = [
        torch.zeros(8, dtype=torch.float32, requires_grad=True),
        torch.zeros(4096, dtype=torch.bfloat16, requires_grad=True),
        torch.zeros(8, dtype=torch.float16, requires_grad=True),
        torch.zeros(4100, dtype=torch.bfloat16, requires_grad=True),
    ]
    opt = AdamW(params, moments="int8", fused=False)
    assert opt.formats() == [
        ("none", "fp32"),
        ("exact", "int8"),
        ("fp32", "fp32"),
        ("exact", "fp32"),
    ]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"master": "fp64"}, "unknown master 'fp64'; valid: auto, none, fp32"),
        ({"moments": "int2"}, "unknown moments 'int2'; valid: fp32, bf16, int8, int4"),
        ({"lr": -1.0}, "Invalid learning rate: -1.0"),
        ({"betas": (0.9, 1.0)}, r"Invalid beta parameter at index 1"),
        ({"weight_decay": -0.1}, "Invalid weight_decay value"),
    ],
)
def test_bad_options_raise_value_error(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        AdamW([torch.zeros(3, requires_grad=True)], fused=False, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("dtype", "master", "match"),
    [
        (torch.float32, "fp32", "needs bf16, fp16 params, got fp32"),
        (torch.float32, "exact", "needs bf16 params, got fp32"),
        (torch.float32, "kahan", "needs bf16, fp16 params"),
        (torch.float16, "exact", "needs bf16 params, got fp16"),
        (torch.float16, "remainder8", "needs bf16 params, got fp16"),
        (torch.float16, "stochastic", "needs bf16 params, got fp16"),
    ],
)
def test_master_dtype_mismatch_raises(dtype: torch.dtype, master: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        AdamW([torch.zeros(3, dtype=dtype, requires_grad=True)], master=master, fused=False)


def test_fused_must_be_bool_or_none() -> None:
    with pytest.raises(TypeError, match="fused must be"):
        AdamW([torch.zeros(3, requires_grad=True)], fused="yes")  # type: ignore[arg-type]


def test_load_rejects_other_formats() -> None:
    p = [torch.zeros(16, dtype=torch.bfloat16, requires_grad=True)]
    sd = AdamW(p, master="exact", fused=False).state_dict()
    other = AdamW([torch.zeros(16, dtype=torch.bfloat16, requires_grad=True)], master="fp32")
    with pytest.raises(ValueError, match="saved master='exact' differs"):
        other.load_state_dict(sd)


def test_closure_maximize_and_zero_grad() -> None:
    w = torch.tensor([1.0, -2.0], requires_grad=True)
    opt = AdamW([w], lr=0.1, weight_decay=0.0, maximize=True, fused=False)

    def closure() -> float:
        opt.zero_grad()
        loss = (w * w).sum()
        loss.backward()  # type: ignore[no-untyped-call]
        return float(loss.detach())

    assert opt.step(closure) == 5.0
    assert w.detach().abs().gt(torch.tensor([1.0, 2.0])).all()  # maximize grows |w|
    opt.zero_grad()
    assert w.grad is None
