"""The hardware behind a run: the device facts every run record holds.

Speed figures belong to a machine: bf16 autocast is several times slower than
fp32 on a CPU without AVX512-BF16 and faster on one with AMX or on a GPU with
tensor cores. Each run therefore records where it ran (`DeviceFacts`): the CPU
model and its precision-relevant flags or the GPU and its compute capability,
the torch version and the thread count. The decision reads them to tell
whether the measurements hold for the contract's `target_device`
(`matches_target`), and the runner reuses a stored run only when it was
measured on the same hardware (`DeviceFacts.key`).

The facts are read from `mixprec.device_caps` and platform facts; probing what
a device can do stays in `mixprec.device`.
"""

from __future__ import annotations

import functools
import platform
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DEVICE_TYPES",
    "GPU_TYPES",
    "PRECISION_FLAGS",
    "DeviceFacts",
    "device_facts",
    "distinct",
    "matches_target",
]

#: Device classes a contract's `target_device` may name; ``gpu`` names any of
#: `GPU_TYPES`, and any other string is matched as whole words of the device name
#: ("H100", "A100", "EPYC").
DEVICE_TYPES: tuple[str, ...] = ("cpu", "cuda", "mps", "xpu")

#: The device types ``target_device: gpu`` stands for.
GPU_TYPES: tuple[str, ...] = ("cuda", "mps", "xpu")

#: CPU flags that decide how fast 16-bit and 8-bit matmuls run: x86 (AVX-512 and its
#: BF16/FP16/VNNI extensions, AMX tiles) and Arm (half-precision SIMD, BF16, I8MM, SVE).
PRECISION_FLAGS: tuple[str, ...] = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512_bf16",
    "avx512_fp16",
    "avx512_vnni",
    "avx_vnni",
    "amx_tile",
    "amx_bf16",
    "amx_fp16",
    "amx_int8",
    "asimdhp",
    "bf16",
    "i8mm",
    "sve",
    "sve2",
    "sme",
)


@dataclass(frozen=True, kw_only=True)
class DeviceFacts:
    """Where one run was measured.

    Attributes:
        device_type: ``cpu``, ``cuda``, ``mps`` or ``xpu``.
        name: the CPU model, or the GPU name with its compute capability.
        capability: ``sm_90`` and the like for CUDA devices, empty otherwise.
        flags: the `PRECISION_FLAGS` this CPU has (empty for a GPU).
        bf16_fast: bf16 matmuls are hardware-accelerated (`DeviceCaps.bf16_fast`).
        fp16_fast: fp16 matmuls are hardware-accelerated (`DeviceCaps.fp16_fast`).
        torch: the torch version.
        threads: torch's intra-op thread count during the run.
        machine: the CPU architecture (``x86_64``, ``aarch64``).
    """

    device_type: str
    name: str
    capability: str = ""
    flags: tuple[str, ...] = ()
    bf16_fast: bool = False
    fp16_fast: bool = False
    torch: str = ""
    threads: int = 0
    machine: str = ""

    @property
    def key(self) -> str:
        """The identity of the measurements: device, torch version and threads. Runs
        with the same key have comparable timings."""
        return f"{self.device_type}|{self.name}|torch {self.torch}|{self.threads} threads"

    @property
    def label(self) -> str:
        """Short: ``cpu AMD EPYC`` or ``cuda NVIDIA H100 80GB HBM3 (sm_90)``."""
        return f"{self.device_type} {self.name}"

    def describe(self) -> str:
        """One line: the device, its precision-relevant features, torch and threads."""
        speeds = f"bf16 {_speed(self.bf16_fast)}, fp16 {_speed(self.fp16_fast)}"
        if self.device_type == "cpu":
            flags = ", ".join(self.flags) or "no AVX-512/AMX/Arm-BF16 flags"
            features = f"{flags}; {speeds.replace('bf16', 'bf16 matmul', 1)}"
        else:
            features = speeds
        plural = "" if self.threads == 1 else "s"
        threads = f", {self.threads} thread{plural}" if self.device_type == "cpu" else ""
        return f"{self.label} ({features}), torch {self.torch}{threads}"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return {
            "device_type": self.device_type,
            "name": self.name,
            "capability": self.capability,
            "flags": list(self.flags),
            "bf16_fast": self.bf16_fast,
            "fp16_fast": self.fp16_fast,
            "torch": self.torch,
            "threads": self.threads,
            "machine": self.machine,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DeviceFacts:
        """Inverse of `to_dict` (unknown keys ignored).

        Raises:
            ValueError: a missing or mistyped field, naming it.
        """
        if not isinstance(data, Mapping):
            raise ValueError(f"field 'device' must be an object, got {data!r}")
        values: dict[str, Any] = {}
        for key in ("device_type", "name", "capability", "torch", "machine"):
            value = data.get(key, "")
            if not isinstance(value, str):
                raise ValueError(f"field 'device.{key}' must be a string, got {value!r}")
            values[key] = value
        if not values["device_type"] or not values["name"]:
            raise ValueError("field 'device' needs a device_type and a name")
        flags = data.get("flags", [])
        if not isinstance(flags, list | tuple) or not all(isinstance(f, str) for f in flags):
            raise ValueError(f"field 'device.flags' must be a list of strings, got {flags!r}")
        values["flags"] = tuple(flags)
        for key in ("bf16_fast", "fp16_fast"):
            value = data.get(key, False)
            if not isinstance(value, bool):
                raise ValueError(f"field 'device.{key}' must be true or false, got {value!r}")
            values[key] = value
        threads = data.get("threads", 0)
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 0:
            raise ValueError(f"field 'device.threads' must be an int >= 0, got {threads!r}")
        values["threads"] = threads
        return cls(**values)


def _speed(fast: bool) -> str:
    return "accelerated" if fast else "emulated"


def _cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


@functools.cache
def _cpu_precision_flags() -> tuple[str, ...]:
    flags = _cpu_flags()
    return tuple(f for f in PRECISION_FLAGS if f in flags)


def device_facts(device: str = "cpu") -> DeviceFacts:
    """The facts of `device` (``cpu``, ``cuda``, ``cuda:1``...) as a run records them.

    Reads `mixprec.device_caps` for the name and the bf16/fp16 speed, the CPU's
    flags, and torch's version and current thread count.
    """
    import torch

    from mixprec.device import device_caps

    dev = torch.device(device)
    caps = device_caps(dev)
    capability = ""
    if dev.type == "cuda":
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        capability = f"sm_{major}{minor}"
    return DeviceFacts(
        device_type=dev.type,
        name=caps.name,
        capability=capability,
        flags=_cpu_precision_flags() if dev.type == "cpu" else (),
        bf16_fast=caps.bf16_fast,
        fp16_fast=caps.fp16_fast,
        torch=str(torch.__version__),
        threads=int(torch.get_num_threads()),
        machine=platform.machine(),
    )


def matches_target(facts: DeviceFacts, target: str) -> bool:
    """Whether measurements on `facts` hold for `target`.

    `target` is a device class (``cuda``; an index as in ``cuda:0`` is ignored,
    since runs on one GPU of a kind transfer to its siblings), ``gpu`` (any
    accelerator: ``cuda``, ``mps``, ``xpu``), or whole words of the device name,
    ignoring case and punctuation (``H100`` and ``h100 80gb`` match ``NVIDIA
    H100 80GB HBM3 (sm_90)``; ``H1`` and ``c`` match nothing).
    """
    wanted = target.strip().lower()
    device_type, colon, index = wanted.partition(":")
    if colon and device_type in DEVICE_TYPES and index.isdigit():
        wanted = device_type
    if wanted in DEVICE_TYPES:
        return facts.device_type == wanted
    if wanted == "gpu":
        return facts.device_type in GPU_TYPES
    words = _words(wanted)
    name = _words(facts.name)
    n = len(words)
    return n > 0 and any(name[i : i + n] == words for i in range(len(name) - n + 1))


def _words(text: str) -> list[str]:
    """Lower-case words of `text`, split at anything but letters, digits and ``_``."""
    return re.findall(r"[a-z0-9_]+", text.lower())


def distinct(facts: Sequence[DeviceFacts | None]) -> list[DeviceFacts | None]:
    """The different hardware among `facts` (by `DeviceFacts.key`; None: not recorded),
    in first-seen order."""
    seen: dict[str, DeviceFacts | None] = {}
    for f in facts:
        seen.setdefault("" if f is None else f.key, f)
    return list(seen.values())
