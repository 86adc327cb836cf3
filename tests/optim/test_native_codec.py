"""The native kernel's master codec (`NativeLibrary.codec`): bitwise the formats' eager
decode and encode for every master it covers, refusing bad input, and used by `Mastered`."""

from __future__ import annotations

import pytest
import torch

from mixprec.formats import master_format
from mixprec.optim import Mastered, native

try:
    LIBRARY: native.NativeLibrary | None = native.library()
    WHY = ""
except native.NativeUnavailableError as exc:  # pragma: no cover - machines without a compiler
    LIBRARY, WHY = None, str(exc)

pytestmark = pytest.mark.skipif(LIBRARY is None, reason=f"native kernel unavailable: {WHY}")

#: Every master with a kernel code but `stochastic` (rounding noise: Mastered refuses it).
MASTERS = ("none", "fp32", "exact", "remainder8", "kahan")

# fp32 bit patterns: +-0, the smallest subnormal and the largest, bf16 ties (low half
# 0x8000, even and odd high half), values at and around bf16 overflow, fp32 max, +-inf.
SPECIAL_BITS = [
    0x00000000, 0x80000000, 0x00000001, 0x807FFFFF, 0x00008000, 0x00018000, 0x3F808000,
    0x3F818000, 0xBF808000, 0x7F7F7FFF, 0x7F7F8000, 0x7F7FFFFF, 0xFF7F8000, 0x7F800000,
    0xFF800000,
]  # fmt: skip


def _values(n: int, seed: int = 0) -> torch.Tensor:
    """fp32 values: the specials, random bit patterns (every exponent, subnormals) and
    normal values; no NaN (its payload may differ between the codecs)."""
    gen = torch.Generator().manual_seed(seed)
    special = torch.tensor(SPECIAL_BITS, dtype=torch.int64).to(torch.int32).view(torch.float32)
    bits = torch.randint(-(2**31), 2**31, (n // 2,), generator=gen, dtype=torch.int64)
    random_bits = bits.to(torch.int32).view(torch.float32)
    normal = torch.randn(n - n // 2, generator=gen) * 1e-2
    out = torch.cat([special, random_bits, normal])[:n]
    return torch.where(out.isnan(), torch.zeros_like(out), out)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, but a NaN's payload and sign (kahan's compensation of +-inf is
    inf - inf: x86's NaN has its sign bit set, torch's conversion keeps it, the kernel
    writes 0x7FC0)."""
    if not a.is_floating_point():
        return torch.equal(a, b)
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(_bits(a[~nan]), _bits(b[~nan]))


def _encode_eager(name: str, values: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    stored, kept = master_format(name).encode(values, dtype=torch.bfloat16, noise=None)
    return stored.contiguous(), [k.contiguous() for k in kept]


@pytest.mark.parametrize("name", MASTERS)
@pytest.mark.parametrize("n", [3, 4096 + 13, 3 * 4096])
def test_codec_equals_eager_bitwise(name: str, n: int) -> None:
    assert LIBRARY is not None
    fmt = master_format(name)
    values = _values(n)
    param, state = _encode_eager(name, values)
    mine_param = torch.zeros_like(param)
    mine_state = [torch.zeros_like(t) for t in state]
    LIBRARY.codec(name, mine_param, mine_state, values, encode=True)
    assert torch.equal(_bits(mine_param), _bits(param))
    for mine, ref in zip(mine_state, state, strict=True):
        assert _same(mine, ref)
    # Decode from the encoded master, and (int8 remainders) from arbitrary bits.
    states = [state]
    if name in ("exact", "remainder8"):
        gen = torch.Generator().manual_seed(1)
        states.append([torch.randint(-128, 128, t.shape, generator=gen).to(t.dtype) for t in state])
    for s in states:
        ref = fmt.decode(param, s).to(torch.float32)
        out = torch.full((n,), float("nan"))
        LIBRARY.codec(name, param, s, out, encode=False)
        assert _same(out, ref)


def test_codec_results_do_not_depend_on_threads() -> None:
    assert LIBRARY is not None
    values = _values(5 * 4096 + 7, seed=3)
    param, state = _encode_eager("exact", values)
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            out = torch.empty_like(values)
            LIBRARY.codec("exact", param, state, out, encode=False)
            outs.append(out)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(_bits(outs[0]), _bits(outs[1]))
    assert torch.equal(_bits(outs[0]), _bits(values))  # exact: the values themselves


def test_codec_fp32_parameter_with_no_master_is_a_copy() -> None:
    assert LIBRARY is not None
    values = _values(100)
    param = torch.zeros(100)
    LIBRARY.codec("none", param, [], values, encode=True)
    assert torch.equal(_bits(param), _bits(values))
    out = torch.empty(100)
    LIBRARY.codec("none", param, [], out, encode=False)
    assert torch.equal(_bits(out), _bits(values))


def test_codec_refuses_bad_input_and_writes_nothing() -> None:
    assert LIBRARY is not None
    values = _values(64)
    param, state = _encode_eager("exact", values)
    kept = [param.clone(), *(t.clone() for t in state)]
    bad = [
        ("exact", param, state, values[::2].repeat(2)[::2]),  # values too short
        ("exact", param, state, values.to(torch.bfloat16)),  # values not fp32
        ("exact", param, state[:1], values),  # a state tensor missing
        ("exact", param, [state[0], state[1][:32]], values),  # a state tensor too short
        ("exact", param, [state[0], state[1].to(torch.int16)], values),  # a state dtype
        ("exact", param, state, torch.stack([values, values], 1)[:, 0]),  # not contiguous
        ("exact", param.float(), state, values),  # exact needs bf16 parameters
        ("exact", param.half(), state, values),  # no fp16 codec
        ("stochastic", param, [], values),  # needs rounding noise: refused
        ("fp32", param, [], values),  # its fp32 master missing
    ]
    for name, p, s, v in bad:
        with pytest.raises(ValueError, match="native codec"):
            LIBRARY.codec(name, p, s, v, encode=True)
    for now, then in zip([param, *state], kept, strict=True):
        assert torch.equal(_bits(now), _bits(then))


@pytest.mark.parametrize("name", MASTERS)
def test_mastered_steps_with_the_native_codec_bitwise_as_eager(name: str) -> None:
    def run(codec: str) -> tuple[Mastered, list[torch.Tensor]]:
        gen = torch.Generator().manual_seed(0)
        params = [
            (torch.randn(shape, generator=gen)).to(torch.bfloat16).requires_grad_()
            for shape in ((4096 + 5,), (33, 17))
        ]
        opt = Mastered(torch.optim.AdamW, params, master=name, codec=codec, lr=1e-2)  # type: ignore[arg-type]
        for _ in range(3):
            for p in params:
                p.grad = (torch.randn(p.shape, generator=gen) * 1e-2).to(torch.bfloat16)
            opt.step()
        return opt, params

    native_opt, native_params = run("auto")
    eager_opt, eager_params = run("eager")
    assert {native_opt.codec_of(p) for p in native_params} == {"native"}
    assert {eager_opt.codec_of(p) for p in eager_params} == {"eager"}
    for a, b in zip(native_params, eager_params, strict=True):
        assert torch.equal(_bits(a.detach()), _bits(b.detach()))
    for a, b in zip(native_opt.master_weights(), eager_opt.master_weights(), strict=True):
        assert torch.equal(_bits(a), _bits(b))


def test_an_unknown_codec_is_refused_naming_the_choices() -> None:
    params = [torch.zeros(4, dtype=torch.bfloat16, requires_grad=True)]
    with pytest.raises(ValueError, match="codec='fast': give one of 'auto'"):
        Mastered(torch.optim.SGD, params, codec="fast", lr=0.1)  # type: ignore[arg-type]
