from __future__ import annotations

import pytest
import torch

from mixprec import device as device_mod
from mixprec.device import device_caps


def test_cpu_caps_are_consistent() -> None:
    caps = device_caps("cpu")
    assert caps.device_type == "cpu"
    assert caps.supported(torch.bfloat16) and caps.supported(torch.float16)
    assert caps.supported(torch.float32) and caps.fast(torch.float32)
    assert caps.fast(torch.bfloat16) == caps.bf16_fast
    assert caps.reason(torch.float16) == caps.fp16_reason
    assert device_caps(torch.device("cpu")) is caps, "cached per device"


def test_cpu_fast_flags_come_from_cpuinfo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device_mod, "_mkldnn_supports", lambda kind: True)
    monkeypatch.setattr(device_mod, "_cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    caps = device_mod._cpu_caps()
    assert caps.bf16_fast and not caps.fp16_fast
    assert "avx512_bf16" in caps.bf16_reason
    assert "many times slower" in caps.fp16_reason


def test_avx512_without_bf16_is_not_fast_even_if_onednn_says_supported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(device_mod, "_mkldnn_supports", lambda kind: True)
    monkeypatch.setattr(device_mod, "_cpu_flags", lambda: frozenset({"avx512f", "avx512bw"}))
    caps = device_mod._cpu_caps()
    assert not caps.bf16_fast and not caps.fp16_fast
    assert "emulated" in caps.bf16_reason


def test_onednn_probe_when_flags_are_unreadable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device_mod, "_mkldnn_supports", lambda kind: kind == "bf16")
    monkeypatch.setattr(device_mod, "_cpu_flags", lambda: frozenset())
    caps = device_mod._cpu_caps()
    assert caps.bf16_fast and not caps.fp16_fast


@pytest.mark.parametrize(
    ("cc", "bf16_fast", "fp16_fast"),
    [((9, 0), True, True), ((8, 0), True, True), ((7, 5), False, True), ((6, 1), False, False)],
)
def test_cuda_caps_by_compute_capability(
    monkeypatch: pytest.MonkeyPatch, cc: tuple[int, int], bf16_fast: bool, fp16_fast: bool
) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: cc)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "Fake GPU")
    monkeypatch.setattr(
        torch.cuda, "is_bf16_supported", lambda including_emulation=True: cc >= (8, 0)
    )
    caps = device_mod._cuda_caps(0)
    assert (caps.bf16_fast, caps.fp16_fast) == (bf16_fast, fp16_fast)
    assert caps.name == f"Fake GPU (sm_{cc[0]}{cc[1]})"
    assert caps.bf16_supported == (cc >= (8, 0))


@pytest.mark.cuda
def test_real_cuda_caps() -> None:
    caps = device_caps("cuda")
    assert caps.device_type == "cuda" and caps.fp16_supported
