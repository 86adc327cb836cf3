"""Rules on what data-parallel wrappers really do, from fake `Reduction` lists (no processes)."""

from __future__ import annotations

import torch

from mixprec.doctor import TrainingFacts, run_static_rules
from mixprec.doctor.findings import Finding
from mixprec.engine.wrappers import Reduction

BF16, FP32 = torch.bfloat16, torch.float32


def _fsdp(
    module: str,
    numel: int,
    *,
    reduce: torch.dtype | None = FP32,
    param: torch.dtype | None = BF16,
    mp: bool = True,
) -> Reduction:
    return Reduction("fsdp2", module, reduce, param, None, mp, numel)


def _ddp(dtype: torch.dtype, numel: int, *, hooked: torch.dtype | None = None) -> Reduction:
    return Reduction("ddp", "", hooked or dtype, dtype, None, hooked is not None, numel)


def _facts(
    found: list[Reduction],
    *,
    compute: torch.dtype | None = BF16,
    params: torch.dtype = BF16,
    policy_reduce: torch.dtype | None = FP32,
) -> TrainingFacts:
    # What `check` would read: the reduce dtype from the wrappers, the policy's beside it.
    worst = next((r.reduce_dtype for r in found if r.numel and r.reduce_dtype != FP32), FP32)
    return TrainingFacts(
        source="live objects",
        dialect="live",
        param_dtype=params,
        compute_dtype=compute,
        reduce_dtype=worst if found else policy_reduce,
        policy_reduce_dtype=policy_reduce,
        reductions=tuple(found),
    )


def _rules(findings: list[Finding]) -> set[str]:
    return {f.rule for f in findings}


def test_fsdp2_groups_reducing_in_bf16_are_reported_with_their_evidence() -> None:
    found = [_fsdp("layers.0", 1000, reduce=BF16), _fsdp("norm", 64), _fsdp("", 500, reduce=BF16)]
    (f,) = run_static_rules(_facts(found))
    assert f.rule == "reduce-dtype-16bit" and f.severity == "warning"
    ev = f.evidence
    assert ev["wrapper"] == "fsdp2" and ev["reduce_dtype"] == "bf16"
    assert ev["groups_16bit"] == 2 and ev["groups_total"] == 3
    assert [g["module"] for g in ev["groups"]] == ["layers.0", ""]
    assert ev["grad_elements_16bit"] == 1500
    # The reduce-scatter buffer of 1500 gradient elements in 2 bytes instead of 4.
    assert ev["grad_bytes_saved_per_step"] == 1500 * 2
    assert ev["wire_bytes_saved_per_rank_per_step"] == 1500 * 2
    assert ev["policy_reduce_dtype"] == "fp32"
    assert "1,500 gradient elements" in f.message and "8 significant bits" in f.message
    assert "small gradients" in f.message and "3,000 bytes" in f.message
    assert "mixprec.distributed.shard(model, policy)" in f.fix


def test_ddp_without_mixprecs_hook_reduces_bf16_gradients_in_bf16() -> None:
    found = [_ddp(BF16, 4000), _ddp(FP32, 100)]  # bf16 storage, fp32 norms
    (f,) = run_static_rules(_facts(found))
    assert f.rule == "reduce-dtype-16bit" and f.severity == "warning"
    ev = f.evidence
    assert ev["wrapper"] == "ddp" and ev["mixprec_hook"] is False
    assert ev["grad_elements_16bit"] == 4000
    assert ev["grad_bytes_saved_per_step"] == 4000 * 2
    # A ring all-reduce sends about twice its buffer per rank (reduce-scatter + all-gather).
    assert ev["wire_bytes_saved_per_rank_per_step"] == 2 * 4000 * 2
    assert "without mixprec's reduction hook" in f.message and "policy says fp32" in f.message
    assert "mixprec.distributed.ddp(model, policy)" in f.fix


def test_wrappers_reducing_in_fp32_are_clean_whatever_the_policy_says() -> None:
    assert run_static_rules(_facts([_ddp(BF16, 4000, hooked=FP32)])) == []
    # The wrappers are the truth: a policy's bf16 reduce dtype is not what runs.
    found = [_fsdp("layers.0", 1000), _fsdp("", 10)]
    assert run_static_rules(_facts(found, policy_reduce=BF16)) == []


def test_fsdp2_with_the_default_policy_under_16bit_compute_and_fp32_storage() -> None:
    found = [
        _fsdp("layers.0", 1000, param=FP32, reduce=FP32, mp=False),
        _fsdp("layers.1", 1000, param=FP32, reduce=FP32, mp=False),
        _fsdp("", 300, param=FP32, reduce=FP32, mp=False),
    ]
    findings = run_static_rules(_facts(found, params=FP32))
    assert _rules(findings) == {"fsdp-without-mixed-precision"}
    (f,) = findings
    assert f.severity == "warning"
    ev = f.evidence
    assert ev["groups_default_policy"] == 3 and ev["numel"] == 2300
    assert ev["compute_dtype"] == "bf16" and ev["param_dtype"] == "fp32"
    # Two all-gathers per step (forward, backward) of 2300 elements: 4 bytes, not 2.
    assert ev["all_gather_bytes_per_step"] == 2 * 2300 * 4
    assert ev["all_gather_bytes_per_step_16bit"] == 2 * 2300 * 2
    assert ev["reduce_scatter_bytes_per_step"] == 2300 * 4
    assert "18,400 bytes" in f.message and "fp32" in f.message
    assert "mixprec.distributed.shard(model, policy)" in f.fix
    assert "MixedPrecisionPolicy(param_dtype=torch.bfloat16" in f.fix


def test_fsdp2_default_policy_is_fine_when_nothing_computes_in_16bit() -> None:
    found = [_fsdp("", 300, param=FP32, reduce=FP32, mp=False)]
    assert run_static_rules(_facts(found, params=FP32, compute=FP32)) == []
    assert run_static_rules(_facts(found, params=FP32, compute=None)) == []
    # fp32 islands of `shard` (a policy of their own, all-gathered in fp32) are fine.
    islands = [_fsdp("norm", 64, param=FP32, mp=True), _fsdp("", 300, param=BF16)]
    assert run_static_rules(_facts(islands, params=FP32)) == []
