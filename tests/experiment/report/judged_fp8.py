"""A judged experiment with FP8 candidates, from constructed records (no training): an
eligible recipe, one rejected against the 16-bit reference, one without a stored trace
(an older record), FP8 traces and the doctor's fp8 findings."""

from __future__ import annotations

from typing import Any

from mixprec.experiment import Contract, RunRecord, decide
from mixprec.experiment.fp8_trace import Fp8Trace, build_fp8_trace

from ..test_fp8_trace import sample, stats
from .judged import Judged

STEPS = 50
BASE = [1.00, 1.02, 0.99]
#: Paired gaps to fp32 per seed. amp_bf16 sits 0.3% below fp32; fp8_rowwise is within
#: 0.5% of fp32 but 0.6-0.8% above amp_bf16: rejected against the 16-bit reference;
#: fp8_tensorwise stays within 0.5% of both.
GAPS = {
    "amp_bf16": [-0.003, -0.003, -0.003],
    "fp8_tensorwise": [0.0, 0.001, 0.0],
    "fp8_rowwise": [0.004, 0.0045, 0.0035],
    "fp8_rowwise_gw_hp": [0.0, 0.0005, 0.001],
}
MEMORY = {"fp32": 4000, "amp_bf16": 3000, "fp8_tensorwise": 2600}
EMULATED = {"fp8": {"recipe": "tensorwise", "emulate": True}}
#: The constructed worst tensor: the grad_output of blocks.1.mlp.c_proj flushes 3% at
#: step 20 (seed 1), the delayed what-if clips 25% of blocks.0.attn.c_proj's input.
WORST = "blocks.1.mlp.c_proj (grad_output)"
UNDERFLOW_FINDING = {
    "rule": "fp8-underflow",
    "severity": "warning",
    "where": WORST,
    "message": "1 fp8 tensor(s) flush non-zero values to zero at step 20",
    "fix": "keep the grad-weight matmul in high precision",
    "evidence": {
        "step": 20,
        "measured": True,
        "fraction": 0.03,
        "threshold": 0.01,
        "first_step": 20,
        "last_step": 40,
        "times_seen": 2,
    },
}


def trace(seed: int) -> Fp8Trace:
    samples = []
    for step in (0, 20, 40):
        samples.append(
            sample(
                step,
                "blocks.1.mlp.c_proj",
                "grad_output",
                underflow=3 if (step, seed) == (20, 1) else 1,
                amax=0.01 * (1 + step),
            )
        )
        samples.append(
            sample(
                step,
                "blocks.0.attn.c_proj",
                delayed=None if step == 0 else stats(saturated=25),
                amax=2.0,
            )
        )
        samples += [sample(step, f"blocks.1.l{i}", "weight", amax=0.5) for i in range(10)]
    out = build_fp8_trace(samples)
    assert out is not None
    return out


def _record(
    policy: str, seed: int, gaps: dict[str, list[float]], effective: dict[str, Any]
) -> RunRecord:
    loss = BASE[seed] * (1 + gaps.get(policy, [0.0] * 3)[seed])
    fp8 = policy.startswith("fp8")
    kw: dict[str, Any] = {"policy_fields": {}}
    if fp8:
        kw["policy_fields"] = EMULATED
        kw["effective"] = effective
        if policy != "fp8_rowwise_gw_hp":  # a record of an earlier mixprec: no trace
            kw["fp8_trace"] = trace(seed)
        if policy == "fp8_tensorwise" and seed == 1:
            kw["doctor"] = (UNDERFLOW_FINDING,)
    return RunRecord(
        workload="shakespeare",
        size="tiny",
        policy=policy,
        seed=seed,
        steps=STEPS,
        schedule_steps=STEPS,
        fingerprint="f",
        heldout_loss=loss,
        metric=1 / loss,
        metric_name="bits_per_char",
        loss_curve=[[i, 2.0 - i / STEPS] for i in range(STEPS)],
        eval_curve=[[0, 2 * loss], [40, loss], [STEPS, loss]],
        bytes={"total": MEMORY.get(policy, 2600) * 2**10},
        predicted_bytes={"total": MEMORY.get(policy, 2600) * 2**10},
        throughput={"steps_per_s": 40.0 if fp8 else 100.0},
        **kw,
    )


def make_judged_fp8(
    objective: str = "balanced",
    *,
    gaps: dict[str, list[float]] | None = None,
    seeds: int = 3,
    effective: dict[str, Any] | None = None,
) -> Judged:
    """FP8 candidates against fp32 and amp_bf16, under `objective` (`gaps`: the paired
    gaps to fp32 per seed, `seeds`: how many seeds ran, `effective`: the FP8 records')."""
    gaps = GAPS if gaps is None else gaps
    contract = Contract(
        workload="shakespeare",
        size="tiny",
        candidates=tuple(gaps),
        seeds=3,
        max_seeds=3,
        train={"steps": STEPS},
        objective=objective,
    )
    records = [
        _record(p, s, gaps, EMULATED if effective is None else effective)
        for s in range(seeds)
        for p in contract.policies
    ]
    decision = decide(records, contract, higher_is_better=False)
    return Judged(contract, tuple(records), decision)
