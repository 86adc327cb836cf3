"""The native kernel's streamed parameter stores (fp32 master): when they are used, and
that the streamed path, with its unaligned heads and partial tails, is bitwise eager."""

from __future__ import annotations

import pytest
import torch

from mixprec.optim import MASTER_KINDS, MOMENT_KINDS, AdamW, native

try:
    native.library()
    HAVE_NATIVE, WHY = True, ""
except native.NativeUnavailableError as exc:  # pragma: no cover - machines without a compiler
    HAVE_NATIVE, WHY = False, str(exc)

needs_native = pytest.mark.skipif(not HAVE_NATIVE, reason=f"native kernel unavailable: {WHY}")

# Bytes one step moves per element: bf16 param 2 + bf16 grad 2 + fp32 master 4 + moments.
MOVED_BYTES = {"fp32": 16, "bf16": 12}
# (offset into the storage in elements, numel): a 64-byte line holds 32 bf16 elements.
# Inside one line; one whole aligned line; a head, lines and a tail; more than one
# 1024-element staging run with a head and a tail; split between two threads.
LAYOUTS = [(0, 5), (5, 20), (0, 32), (3, 61), (31, 1024 * 3 + 7), (1, 4096 * 2 + 13)]


def test_only_big_fp32_master_groups_with_dense_moments_stream() -> None:
    for moments, per_element in MOVED_BYTES.items():
        least = -(-native.STREAM_MIN_BYTES // per_element)
        assert native.streams_params(master="fp32", moments=moments, numel=least)
        assert not native.streams_params(master="fp32", moments=moments, numel=least - 1)
    huge = 2**40
    assert not native.streams_params(master="fp32", moments="int8", numel=huge)
    for master in set(MASTER_KINDS) - {"fp32"}:
        for moments in MOMENT_KINDS:
            assert not native.streams_params(master=master, moments=moments, numel=huge)


def _params(seed: int) -> list[torch.Tensor]:
    """bf16 leaves at the offsets of `LAYOUTS` inside larger buffers (unaligned data)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for offset, numel in LAYOUTS:
        buffer = (torch.randn(offset + numel + 7, generator=gen) * 3).to(torch.bfloat16)
        out.append(buffer[offset : offset + numel].requires_grad_())
    return out


@needs_native
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    ("moments", "grad_dtype"), [("fp32", torch.bfloat16), ("bf16", torch.float32)]
)
def test_streamed_parameter_stores_are_bitwise_the_eager_step(
    monkeypatch: pytest.MonkeyPatch, threads: int, moments: str, grad_dtype: torch.dtype
) -> None:
    monkeypatch.setattr(native.binding, "STREAM_MIN_BYTES", 0)  # stream every group, however small
    assert native.streams_params(master="fp32", moments=moments, numel=1)
    ref_p, nat_p = _params(0), _params(0)
    assert {p.data_ptr() % 64 for p in nat_p} != {0}  # some heads are unaligned
    kw: dict[str, object] = {"master": "fp32", "moments": moments, "weight_decay": 0.1}
    ref = AdamW(ref_p, fused=False, **kw)  # type: ignore[arg-type]
    nat = AdamW(nat_p, fused=True, **kw)  # type: ignore[arg-type]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for step in range(4):
            gen = torch.Generator().manual_seed(100 + step)
            for a, b in zip(ref_p, nat_p, strict=True):
                grad = torch.randn(a.shape, generator=gen) * 10.0 ** (step - 2)
                for p in (a, b):
                    p.grad_dtype = None  # allow fp32 gradients on bf16 params
                    p.grad = grad.to(grad_dtype)
            ref.step()
            nat.step()
    finally:
        torch.set_num_threads(before)
    assert set(nat.kernel_backends().values()) == {"native"}
    for a, b in zip(ref_p, nat_p, strict=True):
        assert torch.equal(a.detach().view(torch.uint8), b.detach().view(torch.uint8))
        for key, value in ref.state[a].items():
            other = nat.state[b][key].reshape(-1).view(torch.uint8)
            assert torch.equal(value.reshape(-1).view(torch.uint8), other), key
