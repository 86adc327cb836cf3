"""Compiled and eager steps agree bitwise; one graph per family; the fused=None rule.

These tests are about the `torch.compile` path, which CPU groups take when the
native kernel is off (``MIXPREC_NATIVE=0``, set for every test here); the native
kernel has its own tests in test_native.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from mixprec.optim import SGD, AdamW, Lion, kernels, step_batch
from mixprec.optim.inductor import vector_bitcasts, vector_bitcasts_supported
from mixprec.optim.kernels import AUTO_COMPILE_MIN_NUMEL, resolve_mode

from .checkpoint import reload

# Two sizes (8192, 32x256) take int8 moments; the others fall back to fp32 moments.
SHAPES = [(4096 + 13,), (7, 11), (3,), (300, 17), (8192,), (32, 256)]


@pytest.fixture(autouse=True)
def _inductor_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MIXPREC_NATIVE", "0")


def _params(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).bfloat16().requires_grad_() for s in SHAPES]


def _steps(opt: torch.optim.Optimizer, params: list[torch.Tensor], steps: range) -> None:
    for step in steps:
        for group in opt.param_groups:
            group["lr"] = 1e-2 / (1 + step)
        gen = torch.Generator().manual_seed(step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).bfloat16()
        opt.step()


@pytest.mark.compile
@pytest.mark.parametrize(
    ("master", "moments"),
    [("exact", "fp32"), ("kahan", "fp32"), ("stochastic", "bf16"), ("remainder8", "int8")],
)
def test_compiled_step_equals_eager_bitwise_with_one_graph_per_family(
    master: str, moments: str
) -> None:
    kw: dict[str, object] = {"master": master, "moments": moments, "seed": 1, "weight_decay": 0.1}
    eager_p, comp_p = _params(0), _params(0)
    eager = AdamW(eager_p, fused=False, **kw)  # type: ignore[arg-type]
    comp = AdamW(comp_p, fused=True, **kw)  # type: ignore[arg-type]
    _steps(eager, eager_p, range(4))
    kernels.family_function.cache_clear()  # fresh functions: count this test's graphs only
    kernels.compiled_family_function.cache_clear()
    torch._dynamo.utils.counters.clear()
    _steps(comp, comp_p, range(2))
    comp, comp_p = reload(comp, comp_p, fused=True, **kw)
    _steps(comp, comp_p, range(2, 4))
    families = {f"adamw_{a}_{b}" for a, b in comp.formats()}
    assert comp.kernels_compiled() == dict.fromkeys(families, True)
    # one graph per family serves every size, and the rebuilt optimizer reuses it
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == len(families)
    for a, b in zip(eager_p, comp_p, strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    for a, b in zip(eager.master_weights(), comp.master_weights(), strict=True):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    for a, b in zip(eager_p, comp_p, strict=True):
        for key, value in eager.state[a].items():
            assert torch.equal(value, comp.state[b][key]), key


@pytest.mark.parametrize(
    ("fused", "device_type", "numel", "mode"),
    [
        (True, "cpu", 10, "compiled"),
        (False, "cuda", 1 << 30, "eager"),
        (None, "cuda", 10, "auto"),
        (None, "cpu", AUTO_COMPILE_MIN_NUMEL - 1, "eager"),
        (None, "cpu", AUTO_COMPILE_MIN_NUMEL, "auto"),
    ],
)
def test_resolve_mode(fused: bool | None, device_type: str, numel: int, mode: str) -> None:
    assert resolve_mode(fused, device_type=device_type, numel=numel) == mode


def test_small_models_never_compile_under_auto() -> None:
    assert AUTO_COMPILE_MIN_NUMEL >= 1 << 20  # the built-in workloads stay below 2**20
    params = _params(0)
    opt = AdamW(params, moments="int8")  # fused=None
    torch._dynamo.utils.counters.clear()
    _steps(opt, params, range(2))
    assert opt.kernels_compiled() == {"adamw_exact_fp32": False, "adamw_exact_int8": False}
    assert not torch._dynamo.utils.counters["frames"]


@pytest.mark.compile
def test_large_groups_compile_under_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "AUTO_COMPILE_MIN_NUMEL", 10_000)
    small, large = _params(0)[:4], _params(0)[4:]  # 9289 and 16384 elements
    opt = AdamW([{"params": small}, {"params": large}], moments="fp32", weight_decay=0.1)
    ref_small, ref_large = _params(0)[:4], _params(0)[4:]
    ref = AdamW(ref_small + ref_large, moments="fp32", weight_decay=0.1, fused=False)
    _steps(opt, small + large, range(2))
    _steps(ref, ref_small + ref_large, range(2))
    kernels_used = [b.kernel for gs in opt._steps if gs for b in gs.batches]
    assert [k.is_compiled for k in kernels_used] == [False, True]
    for a, b in zip(small + large, ref_small + ref_large, strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.fixture
def broken_compiler(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    def broken(*args: object, **kwargs: object) -> object:
        def fail(*a: object, **k: object) -> None:
            raise RuntimeError("no compiler")

        return fail

    monkeypatch.setattr(torch, "compile", broken)
    kernels.compiled_family_function.cache_clear()
    step_batch.clear_kernels()  # kernels are process-wide: none made with a compiler
    yield
    kernels.compiled_family_function.cache_clear()
    step_batch.clear_kernels()


@pytest.mark.usefixtures("broken_compiler")
def test_compile_failure_falls_back_loudly() -> None:
    p = torch.ones(8, dtype=torch.bfloat16, requires_grad=True)
    p.grad = torch.ones_like(p)
    opt = AdamW([p], master="exact", fused=True)
    with pytest.raises(RuntimeError, match="no compiler"):
        opt.step()  # fused=True: a failure raises
    kernel = opt._steps[0].batches[0].kernel  # type: ignore[union-attr]
    kernel.mode = "auto"  # what fused=None does for a large group
    with pytest.warns(RuntimeWarning, match="running the eager step instead"):
        opt.step()
    assert not kernel.is_compiled
    assert float(opt.master_weights()[0][0]) < 1.0  # the eager step ran


@pytest.mark.compile
@pytest.mark.skipif(not vector_bitcasts_supported(), reason="Inductor lacks the codegen hook")
def test_vector_bitcasts_emit_register_casts_and_restore_inductor() -> None:
    from torch._inductor.codegen.cpp import CppVecOverrides
    from torch._inductor.utils import fresh_cache, run_and_get_code

    def flip_low_bit(x: torch.Tensor) -> torch.Tensor:
        return (x.view(torch.int32) ^ 1).view(torch.float32) * 2.0

    original = vars(CppVecOverrides)["to_dtype_bitcast"]
    x = torch.randn(1000)
    with fresh_cache(), vector_bitcasts():
        out, code = run_and_get_code(torch.compile(flip_low_bit, fullgraph=True), x)
    assert vars(CppVecOverrides)["to_dtype_bitcast"] is original
    assert torch.equal(out, flip_low_bit(x))
    source = "\n".join(code)
    assert "at::vec::cast<int32_t>" in source and "c10::bit_cast" not in source


@pytest.mark.compile
@pytest.mark.parametrize(
    ("make", "family"),
    [
        (
            lambda ps, **kw: AdamW(ps, amsgrad=True, moments="bf16", **kw),
            "adamw_amsgrad_exact_bf16",
        ),
        (
            lambda ps, **kw: SGD(ps, lr=0.1, momentum=0.9, nesterov=True, moments="bf16", **kw),
            "sgd_nesterov_exact_bf16",
        ),
        (lambda ps, **kw: Lion(ps, lr=1e-3, weight_decay=0.1, **kw), "lion_exact_fp32"),
    ],
)
def test_each_rule_compiles_to_the_eager_steps_bits(make: Any, family: str) -> None:
    """AMSGrad, SGD and Lion through torch.compile equal their eager reference bitwise."""
    eager_p, comp_p = _params(0)[4:5], _params(0)[4:5]
    eager = make(eager_p, fused=False, min_int8_numel=0)
    comp = make(comp_p, fused=True, min_int8_numel=0)
    _steps(eager, eager_p, range(3))
    _steps(comp, comp_p, range(3))
    assert comp.kernels_compiled() == {family: True}
    for a, b in zip(eager.master_weights(), comp.master_weights(), strict=True):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    for a, b in zip(eager_p, comp_p, strict=True):
        for key, value in eager.state[a].items():
            assert torch.equal(value, comp.state[b][key]), key
