"""What a device can do with each 16-bit format (and fp8): supported at all, and fast.

"Supported" means `torch.autocast` can run the format on that device type.
"Fast" means its matmuls run on hardware that makes them quicker than fp32
(tensor cores on Ampere+ GPUs for bf16, AVX512-BF16/AMX on CPUs). The two differ:
fp16 autocast runs on any modern CPU, but without AVX512-FP16/AMX-FP16 its
matmuls are emulated and many times slower than fp32. fp8 matmuls need FP8 tensor
cores (CUDA capability 8.9+: Ada, Hopper, Blackwell); elsewhere, every CPU included,
torchao's float8 training runs emulated, which measures numerics, not speed.
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass

import torch

from mixprec.floats import canonical_name, is_fp8_name

__all__ = ["DeviceCaps", "device_caps", "resolve_device"]


@dataclass(frozen=True, kw_only=True)
class DeviceCaps:
    """The 16-bit and fp8 capabilities of one device.

    Attributes:
        device_type: ``"cpu"``, ``"cuda"``, ``"mps"``...
        name: a human-readable name of the device.
        bf16_supported: autocast can compute in bf16 here.
        fp16_supported: autocast can compute in fp16 here.
        bf16_fast: bf16 matmuls are hardware-accelerated.
        fp16_fast: fp16 matmuls are hardware-accelerated.
        bf16_reason: why bf16 is (not) supported/fast, in one sentence.
        fp16_reason: why fp16 is (not) supported/fast, in one sentence.
        fp8_fast: fp8 matmuls run on FP8 units (CUDA capability 8.9+); False where
            fp8 can only be emulated (every CPU) or was not probed.
        fp8_reason: why fp8 is (not) fast, in one sentence.
    """

    device_type: str
    name: str
    bf16_supported: bool
    fp16_supported: bool
    bf16_fast: bool
    fp16_fast: bool
    bf16_reason: str
    fp16_reason: str
    fp8_fast: bool = False
    fp8_reason: str = ""

    def supported(self, dtype: torch.dtype | str) -> bool:
        """Whether autocast can compute in `dtype` (a dtype or its name) on this device
        (fp32 always can; fp8 always can, emulated where it is not `fast`)."""
        name = _name(dtype)
        if is_fp8_name(name):
            return True
        if name == "bf16":
            return self.bf16_supported
        if name == "fp16":
            return self.fp16_supported
        return name == "fp32"

    def fast(self, dtype: torch.dtype | str) -> bool:
        """Whether `dtype` (a dtype or its name) matmuls are hardware-accelerated here."""
        name = _name(dtype)
        if is_fp8_name(name):
            return self.fp8_fast
        if name == "bf16":
            return self.bf16_fast
        if name == "fp16":
            return self.fp16_fast
        return name == "fp32"

    def reason(self, dtype: torch.dtype | str) -> str:
        """One sentence on the support and speed of `dtype` (a dtype or its name) here."""
        name = _name(dtype)
        if is_fp8_name(name):
            return self.fp8_reason or (
                f"fp8 {'fast' if self.fp8_fast else 'not known to be fast'} on {self.name}"
            )
        if name == "bf16":
            return self.bf16_reason
        if name == "fp16":
            return self.fp16_reason
        return "fp32 is supported everywhere"


def _name(dtype: object) -> str | None:
    if isinstance(dtype, str) and dtype.strip().lower() == "fp8":
        return "fp8_e4m3"  # the family: both fp8 formats share their units
    try:
        return canonical_name(dtype)
    except (TypeError, ValueError):
        return None


def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                key = line.split(":", 1)[0].strip()
                if key in ("flags", "Features"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def _mkldnn_supports(kind: str) -> bool | None:
    """oneDNN's own check (what Inductor uses); None when this torch lacks it."""
    try:
        if kind == "bf16":
            return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):
        return None


def _cpu_caps() -> DeviceCaps:
    flags = _cpu_flags()
    name = _cpu_model()
    # Native bf16 dot products: AVX512-BF16 / AMX-BF16 on x86, the BF16 extension on Arm.
    bf16_flags = sorted(flags & {"avx512_bf16", "amx_bf16", "bf16"})
    # Native fp16 arithmetic: AVX512-FP16 / AMX-FP16 on x86; half-precision SIMD on Arm.
    fp16_flags = sorted(flags & {"avx512_fp16", "amx_fp16", "asimdhp"})
    if flags:
        # oneDNN's own probe is not used when the flags are readable: it reports bf16
        # support on any AVX512 CPU, where bf16 matmuls are emulated and measured 3-5x
        # slower than fp32 (Xeon without avx512_bf16, torch 2.13).
        bf16_fast, fp16_fast = bool(bf16_flags), bool(fp16_flags)
    else:
        bf16_fast = bool(_mkldnn_supports("bf16"))
        fp16_fast = bool(_mkldnn_supports("fp16"))
    bf16_reason = (
        f"bf16 matmul is accelerated on this CPU ({', '.join(bf16_flags) or 'oneDNN'})"
        if bf16_fast
        else "this CPU has no AVX512-BF16/AMX-BF16: bf16 autocast runs, but its matmuls are "
        "emulated and typically slower than fp32"
    )
    fp16_reason = (
        f"fp16 matmul is accelerated on this CPU ({', '.join(fp16_flags) or 'oneDNN'})"
        if fp16_fast
        else "this CPU has no AVX512-FP16/AMX-FP16: fp16 autocast runs but its matmuls are "
        "emulated, typically many times slower than fp32"
    )
    return DeviceCaps(
        device_type="cpu",
        name=name,
        bf16_supported=True,
        fp16_supported=True,
        bf16_fast=bf16_fast,
        fp16_fast=fp16_fast,
        bf16_reason=bf16_reason,
        fp16_reason=fp16_reason,
        fp8_fast=False,
        fp8_reason=_CPU_FP8_REASON,
    )


#: No CPU has FP8 matmul units (torch 2.13; AMX and AVX512 stop at bf16/fp16/int8).
_CPU_FP8_REASON = (
    "CPUs have no FP8 matmul units: torchao float8 runs emulated (Float8LinearConfig("
    "emulate=True): casts to fp8 and back, matmuls in high precision), which measures "
    "fp8 numerics, not fp8 speed"
)


def _cuda_caps(index: int) -> DeviceCaps:
    major, minor = torch.cuda.get_device_capability(index)
    name = f"{torch.cuda.get_device_name(index)} (sm_{major}{minor})"
    try:
        bf16_supported = bool(torch.cuda.is_bf16_supported(including_emulation=False))
    except TypeError:  # older signature
        bf16_supported = bool(torch.cuda.is_bf16_supported())
    bf16_fast = (major, minor) >= (8, 0)
    fp16_fast = (major, minor) >= (7, 0) or (major, minor) == (6, 0)
    fp8_fast = (major, minor) >= (8, 9)  # FP8 tensor cores: Ada (8.9), Hopper (9.0), Blackwell
    return DeviceCaps(
        device_type="cuda",
        name=name,
        bf16_supported=bf16_supported,
        fp16_supported=True,
        bf16_fast=bf16_fast,
        fp16_fast=fp16_fast,
        bf16_reason=(
            f"sm_{major}{minor} has bf16 tensor cores"
            if bf16_fast
            else f"sm_{major}{minor} predates Ampere: no bf16 tensor cores"
        ),
        fp16_reason=(
            f"sm_{major}{minor} has fast fp16"
            if fp16_fast
            else f"sm_{major}{minor} has no fast fp16 arithmetic"
        ),
        fp8_fast=fp8_fast,
        fp8_reason=(
            f"sm_{major}{minor} has FP8 tensor cores"
            if fp8_fast
            else f"sm_{major}{minor} predates Ada/Hopper (capability 8.9): no FP8 tensor cores, "
            "so fp8 runs emulated, which measures numerics, not speed"
        ),
    )


def _generic_caps(device_type: str) -> DeviceCaps:
    return DeviceCaps(
        device_type=device_type,
        name=device_type,
        bf16_supported=True,
        fp16_supported=True,
        bf16_fast=True,
        fp16_fast=True,
        bf16_reason=f"assumed supported and fast on {device_type} (not probed)",
        fp16_reason=f"assumed supported and fast on {device_type} (not probed)",
        fp8_fast=False,
        fp8_reason=f"no FP8 units known on {device_type} (not probed): fp8 runs emulated",
    )


@functools.cache
def _caps_cached(device_type: str, index: int) -> DeviceCaps:
    if device_type == "cpu":
        return _cpu_caps()
    if device_type == "cuda":
        return _cuda_caps(index)
    return _generic_caps(device_type)


def device_caps(device: torch.device | str | None = None) -> DeviceCaps:
    """The 16-bit and fp8 capabilities of `device` (default: the current CUDA device if
    any, else CPU).

    Results are cached per device.
    """
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    dev = torch.device(device)
    index = dev.index if dev.index is not None else 0
    if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
        index = torch.cuda.current_device()
    return _caps_cached(dev.type, index)


_DEVICE_TYPES = ("cpu", "cuda", "mps", "xpu")


def resolve_device(device: torch.device | str) -> torch.device:
    """`device` parsed and checked to exist on this machine.

    Raises:
        ValueError: an unknown device string, or a device this machine lacks,
            naming it and the fix.
    """
    if isinstance(device, str) and not device.strip():
        raise ValueError("device is empty: give cpu, cuda, cuda:N, mps or xpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {device!r}: give cpu, cuda, cuda:N, mps or xpu") from None
    if dev.type not in _DEVICE_TYPES:
        raise ValueError(f"device {device!r} is not supported: give one of {_DEVICE_TYPES}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device {device!r}: this machine has no CUDA device (torch "
                f"{torch.__version__}); use --device cpu"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(
                f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s) here"
            )
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device {device!r}: MPS is not available here; use --device cpu")
    elif dev.type == "xpu" and not (hasattr(torch, "xpu") and torch.xpu.is_available()):
        raise ValueError(f"device {device!r}: no XPU device here; use --device cpu")
    return dev
