"""int4 moments: code error against float64, zero-free squares, state and compiled parity."""

from __future__ import annotations

import io

import pytest
import torch
from tests.tolerances import (
    INT4_DIGITS_LOSS_GAP,
    INT4_FP32_SLACK,
    INT4_SIGNED_HALF_STEP,
    INT4_SQUARE_HALF_STEP,
)

from mixprec.formats import moment_format, moment_spec
from mixprec.formats.moments.int4 import (
    BLOCK_SIZE,
    Int4Moments,
    dequantize_rank1,
    dequantize_signed4,
    pack,
    quantize_rank1,
    quantize_signed4,
    unpack,
)
from mixprec.optim import SGD, AdamW, Lion, kernels


def _wide(gen: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    # Magnitudes over 12 decades, with outlier rows and columns.
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    x = x * torch.exp(torch.randn(shape, generator=gen, dtype=torch.float64) * 3)
    x[3] *= 1e4
    x[:, 5] *= 1e-4
    return x


def test_pack_round_trips_and_packs_along_the_last_dim() -> None:
    codes = torch.randint(0, 16, (6, 10), dtype=torch.uint8)
    packed = pack(codes)
    assert packed.shape == (6, 5)
    assert torch.equal(packed[0, 0], codes[0, 0] | (codes[0, 1] << 4))
    assert torch.equal(unpack(packed), codes)


def test_signed_code_error_within_half_a_step_against_float64() -> None:
    gen = torch.Generator().manual_seed(0)
    m64 = _wide(gen, (64, 256))
    m = m64.float()
    packed, absmax = quantize_signed4(m)
    got = dequantize_signed4(packed, absmax).double()
    blocks = m.double().reshape(-1, BLOCK_SIZE)
    amax = blocks.abs().amax(dim=1, keepdim=True)
    s = (blocks.abs() / amax).sqrt()
    bound = amax * ((2 * s + INT4_SIGNED_HALF_STEP) * INT4_SIGNED_HALF_STEP + INT4_FP32_SLACK)
    err = (got.reshape(-1, BLOCK_SIZE) - m64.reshape(-1, BLOCK_SIZE)).abs()
    assert (err <= bound).all(), float((err / bound).max())
    assert torch.equal(torch.sign(got[got != 0]), torch.sign(m64[got != 0]))


def test_square_code_error_within_half_a_level_and_never_zero() -> None:
    gen = torch.Generator().manual_seed(1)
    v64 = _wide(gen, (48, 96)).square()
    v64[7, 9] = 0.0  # a zero where its row and column are not
    v = v64.float()
    packed, rowmax, colmax = quantize_rank1(v)
    got = dequantize_rank1(packed, rowmax, colmax).double()
    scale = torch.minimum(v.double().amax(1)[:, None], v.double().amax(0)[None, :])
    low = scale / 16
    bound = torch.where(v64 >= low, scale * INT4_SQUARE_HALF_STEP, low - v64)
    err = (got - v64).abs()
    assert (err <= bound + scale * INT4_FP32_SLACK).all(), float((err / bound).max())
    assert (got[v64 > 0] > 0).all()  # zero-free: a nonzero v never decodes to 0
    assert got[7, 9] > 0  # the code has no zero: an exact 0 decodes to the lowest level


def test_square_code_of_a_zero_matrix_and_an_overflow_stays_finite() -> None:
    zeros = torch.zeros(4, 8)
    assert torch.equal(dequantize_rank1(*quantize_rank1(zeros)), zeros)
    v = torch.rand(4, 8) + 0.5
    v[1, 2] = float("inf")
    got = dequantize_rank1(*quantize_rank1(v))
    assert torch.isfinite(got).all()


def test_spec_bytes_per_parameter() -> None:
    spec = moment_spec("int4")
    # AdamW, a 768 x 768 matrix: 0.5 + 0.5 bytes of codes, 4 / 128 of absmax,
    # 4 * (768 + 768) of row and column maxima.
    n = 768 * 768
    assert spec.nbytes(n, rows=768) == n // 2 * 2 + 4 * (n // 128) + 4 * 1536
    fresh = moment_format("int4").init_state(
        torch.empty(768, 768), (("exp_avg", "signed"), ("exp_avg_sq", "square"))
    )
    assert sum(t.numel() * t.element_size() for t in fresh.values()) == spec.nbytes(n, rows=768)


@pytest.mark.parametrize(
    ("shape", "fits"),
    [
        ((64, 128), True),
        ((32, 4, 64), True),  # cols 256
        ((16, 128, 3), True),  # a conv-like weight: cols 384, odd last dim
        ((64, 96), False),  # whole blocks in all, but a block would straddle two rows
        ((4096,), False),
        ((0, 128), False),
    ],
)
def test_int4_fits_matrices_whose_rows_are_whole_blocks(shape: tuple[int, ...], fits: bool) -> None:
    assert Int4Moments.fits(shape) is fits


def test_int4_state_is_laid_out_by_rows() -> None:
    slots = (("exp_avg", "signed"), ("exp_avg_sq", "square"))
    state = Int4Moments().init_state(torch.empty(16, 128, 3), slots)
    shapes = {key: tuple(t.shape) for key, t in state.items()}
    assert shapes == {
        "exp_avg_i4": (16, 192),
        "exp_avg_absmax": (16, 3),
        "exp_avg_sq_u4": (16, 192),
        "exp_avg_sq_rowmax": (16,),
        "exp_avg_sq_colmax": (384,),
    }
    # Each block's absmax is its row's: a row of large values does not scale the next.
    m = torch.cat([torch.full((1, 256), 1e-3), torch.full((1, 256), 1e3)])
    packed, absmax = quantize_signed4(m)
    assert packed.shape == (2, 128)
    assert torch.equal(absmax, m.reshape(2, 2, 128).amax(dim=-1))
    # (a block spanning both rows would scale row 0 by 1e3: 1e-6 of it decodes to 0)
    torch.testing.assert_close(dequantize_signed4(packed, absmax), m, rtol=1e-6, atol=0)


def _params(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    # two int4; fallbacks: fp32 (1-D, small), int8 (rows that are not whole blocks)
    shapes = [(64, 128), (32, 4, 64), (300,), (8, 8), (64, 96)]
    return [torch.randn(s, generator=gen).bfloat16().requires_grad_() for s in shapes]


def _steps(opt: torch.optim.Optimizer, params: list[torch.Tensor], steps: range) -> None:
    for step in steps:
        gen = torch.Generator().manual_seed(step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        opt.step()


def _reload(
    opt: torch.optim.Optimizer, params: list[torch.Tensor], cls: type, **kw: object
) -> tuple[torch.optim.Optimizer, list[torch.Tensor]]:
    buf = io.BytesIO()
    torch.save({"opt": opt.state_dict(), "params": [p.detach() for p in params]}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    fresh = [p.clone().requires_grad_() for p in saved["params"]]
    new = cls(fresh, **kw)
    new.load_state_dict(saved["opt"])
    return new, fresh


@pytest.mark.parametrize(
    ("cls", "extra"),
    [(AdamW, {}), (AdamW, {"amsgrad": True}), (Lion, {}), (SGD, {"momentum": 0.9})],
)
def test_int4_state_round_trips_bitwise_through_state_dict(
    cls: type, extra: dict[str, object]
) -> None:
    kw: dict[str, object] = {"lr": 1e-2, "moments": "int4", "fused": False, **extra}
    a_p, b_p = _params(0), _params(0)
    a, b = cls(a_p, **kw), cls(b_p, **kw)
    _steps(a, a_p, range(3))
    _steps(b, b_p, range(3))
    state = b.state[b_p[0]]
    assert state[next(k for k in state if k.endswith("_i4"))].shape == (64, 64)
    assert not any(k.endswith("_i4") for k in b.state[b_p[2]])  # 1-D: fp32 moments
    b, b_p = _reload(b, b_p, cls, **kw)
    _steps(a, a_p, range(3, 6))
    _steps(b, b_p, range(3, 6))
    for pa, pb in zip(a_p, b_p, strict=True):
        assert torch.equal(pa, pb)
        for key, value in a.state[pa].items():
            assert torch.equal(value, b.state[pb][key]), key


def test_int4_refuses_no_tensor_it_cannot_hold_and_falls_back_to_int8_then_fp32() -> None:
    params = _params(0)
    opt = AdamW(params, moments="int4", fused=False)
    _steps(opt, params, range(1))
    kept = {tuple(p.shape): sorted(opt.state[p]) for p in params}
    assert "exp_avg_u4" not in kept[(64, 128)]  # the signed moment is _i4, the square _u4
    assert "exp_avg_sq_u4" in kept[(64, 128)] and "exp_avg_sq_u4" in kept[(32, 4, 64)]
    assert "exp_avg_sq" in kept[(300,)] and "exp_avg_sq" in kept[(8, 8)]
    # rows of 96: not whole int4 blocks, but 6144 elements are whole int8 blocks of 256
    assert "exp_avg_sq_u8" in kept[(64, 96)]
    assert [m for _, m in opt.formats()] == ["int4", "int4", "fp32", "fp32", "int8"]


@pytest.mark.compile
def test_compiled_int4_step_equals_eager_bitwise(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MIXPREC_NATIVE", "0")
    kw: dict[str, object] = {"lr": 1e-2, "moments": "int4", "weight_decay": 0.1}
    # One int4 parameter: each width is a graph of its own (only dim 0 is dynamic).
    eager_p, comp_p = _params(0)[:1], _params(0)[:1]
    eager = AdamW(eager_p, fused=False, **kw)
    comp = AdamW(comp_p, fused=True, **kw)
    kernels.compiled_family_function.cache_clear()
    _steps(eager, eager_p, range(2))
    _steps(comp, comp_p, range(2))
    for pe, pc in zip(eager_p, comp_p, strict=True):
        assert torch.equal(pe, pc)
        for key, value in eager.state[pe].items():
            assert torch.equal(value, comp.state[pc][key]), key


def _digits_loss(moments: str) -> float:
    from sklearn.datasets import load_digits

    x_np, y_np = load_digits(return_X_y=True)
    x = torch.tensor(x_np, dtype=torch.float32) / 16
    y = torch.tensor(y_np)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 128),
        torch.nn.ReLU(),
        torch.nn.Linear(128, 128),
        torch.nn.ReLU(),
        torch.nn.Linear(128, 10),
    )
    opt = AdamW(model.parameters(), lr=3e-3, moments=moments, fused=False)
    gen = torch.Generator().manual_seed(0)
    for _ in range(150):
        idx = torch.randint(0, len(x), (64,), generator=gen)
        loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        return float(torch.nn.functional.cross_entropy(model(x), y))


def test_adamw_with_int4_moments_trains_digits_close_to_fp32() -> None:
    fp32, int4 = _digits_loss("fp32"), _digits_loss("int4")
    assert int4 - fp32 <= INT4_DIGITS_LOSS_GAP, (fp32, int4)
