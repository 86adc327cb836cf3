"""Device facts: what a run record says about where it was measured."""

from __future__ import annotations

import pytest
import torch

from mixprec.device import device_caps
from mixprec.experiment.hardware import (
    PRECISION_FLAGS,
    DeviceFacts,
    device_facts,
    distinct,
    matches_target,
)
from mixprec.experiment.records import RunRecord

XEON = DeviceFacts(
    device_type="cpu",
    name="Intel(R) Xeon(R) Platinum 8481C",
    flags=("avx512f", "avx512_bf16", "amx_bf16"),
    bf16_fast=True,
    torch="2.13.0",
    threads=2,
    machine="x86_64",
)
H100 = DeviceFacts(
    device_type="cuda",
    name="NVIDIA H100 80GB HBM3 (sm_90)",
    capability="sm_90",
    bf16_fast=True,
    fp16_fast=True,
    torch="2.13.0",
    threads=8,
)


def test_facts_of_this_cpu_come_from_device_caps() -> None:
    facts = device_facts("cpu")
    caps = device_caps("cpu")
    assert facts.device_type == "cpu" and facts.name == caps.name
    assert (facts.bf16_fast, facts.fp16_fast) == (caps.bf16_fast, caps.fp16_fast)
    assert facts.torch == torch.__version__ and facts.threads == torch.get_num_threads()
    assert set(facts.flags) <= set(PRECISION_FLAGS) and facts.capability == ""
    assert facts.describe().startswith(f"cpu {caps.name} (")


def test_describe_names_flags_speed_torch_and_threads() -> None:
    assert XEON.describe() == (
        "cpu Intel(R) Xeon(R) Platinum 8481C (avx512f, avx512_bf16, amx_bf16; bf16 matmul "
        "accelerated, fp16 emulated), torch 2.13.0, 2 threads"
    )
    assert H100.describe() == (
        "cuda NVIDIA H100 80GB HBM3 (sm_90) (bf16 accelerated, fp16 accelerated), torch 2.13.0"
    )


@pytest.mark.parametrize(
    ("target", "xeon", "h100"),
    [
        ("cpu", True, False),
        ("cuda", False, True),
        ("CUDA", False, True),
        ("H100", False, True),
        ("h100", False, True),
        ("A100", False, False),
        ("Xeon", True, False),
        ("mps", False, False),
        ("cuda:0", False, True),
        ("cpu:1", True, False),
        ("gpu", False, True),
        ("GPU", False, True),
        ("sm_90", False, True),
        ("H100 80GB", False, True),
        ("Platinum 8481C", True, False),
        # name parts are whole words: a letter or a fragment matches nothing
        ("c", False, False),
        ("H1", False, False),
        ("Xeo", False, False),
        ("8481", False, False),
    ],
)
def test_a_target_is_a_device_class_or_part_of_the_name(
    target: str, xeon: bool, h100: bool
) -> None:
    assert matches_target(XEON, target) is xeon
    assert matches_target(H100, target) is h100


def test_the_key_separates_what_changes_timings() -> None:
    assert XEON.key != DeviceFacts(**{**XEON.to_dict(), "flags": XEON.flags, "threads": 4}).key
    assert XEON.key != DeviceFacts(**{**XEON.to_dict(), "flags": XEON.flags, "torch": "2.6"}).key
    assert distinct([XEON, H100, XEON, None, None]) == [XEON, H100, None]


def test_facts_round_trip_through_a_run_record() -> None:
    record = RunRecord(
        workload="w", size="s", policy="fp32", policy_fields={}, seed=0, steps=1,
        fingerprint="f", device=XEON,
    )  # fmt: skip
    data = record.to_dict()
    assert data["device"]["flags"] == ["avx512f", "avx512_bf16", "amx_bf16"]
    assert RunRecord.from_dict(data).device == XEON
    older = {k: v for k, v in data.items() if k != "device"}
    assert RunRecord.from_dict(older).device is None


@pytest.mark.parametrize(
    ("device", "message"),
    [
        ([], "field 'device' must be an object"),
        ({"device_type": "cpu"}, "needs a device_type and a name"),
        ({"device_type": "cpu", "name": "x", "flags": "avx"}, "device.flags"),
        ({"device_type": "cpu", "name": "x", "threads": -1}, "device.threads"),
        ({"device_type": "cpu", "name": "x", "bf16_fast": 1}, "device.bf16_fast"),
    ],
)
def test_bad_device_facts_are_refused_naming_the_field(device: object, message: str) -> None:
    data = RunRecord(
        workload="w", size="s", policy="fp32", policy_fields={}, seed=0, steps=1, fingerprint="f"
    ).to_dict()
    data["device"] = device
    with pytest.raises(ValueError, match=message):
        RunRecord.from_dict(data)
