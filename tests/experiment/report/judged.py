"""A judged experiment built from constructed run records (no training): every kind
of row the report shows, a capped run, a loss-scale trace and doctor findings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mixprec.experiment import Contract, Decision, RunRecord, decide
from mixprec.experiment.summary import tail_start

STEPS = 50
CAP = 10
#: Paired relative gaps per seed: recommended, inconclusive, capped and eligible, and
#: within the gap but rejected by its doctor error.
GAPS = {
    "bf16_master": [0.001, 0.002, 0.0015],
    "amp_bf16": [0.0, 0.02, -0.01],
    "amp_fp16": [0.0005, 0.001, 0.0],
    "bf16_pure": [0.001, 0.002, 0.001],
}
MEMORY = {"fp32": 4000, "bf16_master": 2500, "amp_bf16": 3900, "amp_fp16": 3800, "bf16_pure": 1200}
#: A doctor error on the update path (rejects bf16_pure) and a warning, both with
#: characters each format has to escape.
FINDINGS = (
    {
        "rule": "vanishing-updates",
        "severity": "error",
        "where": "optimizer",
        "message": "41.5% of updates | rounded away (< half a bf16 ulp)",
        "fix": "keep an fp32 master & retry",
    },
    {
        "rule": "loss-scale-headroom",
        "severity": "warning",
        "where": "scaler",
        "message": "scale 65536 left 2.5% headroom",
        "fix": "lower init_scale",
    },
)


@dataclass(frozen=True)
class Judged:
    """A contract, its records and the decision over them."""

    contract: Contract
    records: tuple[RunRecord, ...]
    decision: Decision


def _record(policy: str, seed: int, **kw: Any) -> RunRecord:
    base = 1.0 + seed / 10
    steps = CAP if policy == "amp_fp16" else STEPS
    loss = base * (1 + GAPS[policy][seed]) if policy in GAPS else base
    curve = [[0, 2 * base], [tail_start(CAP), base], [CAP, base]]
    curve += [[tail_start(STEPS), base], [STEPS, base]]
    if policy != "fp32":
        curve = [[0, 2 * loss], [tail_start(steps), loss], [steps, loss]]
    return RunRecord(
        workload="digits",
        size="tiny",
        policy=policy,
        policy_fields={},
        seed=seed,
        steps=steps,
        schedule_steps=STEPS,
        fingerprint="f",
        heldout_loss=loss,
        metric=0.9 - GAPS.get(policy, [0.0] * 3)[seed],
        metric_name="macro_f1",
        loss_curve=[[i, 2.0 - i / STEPS] for i in range(steps)],
        eval_curve=curve,
        bytes={"total": MEMORY[policy] * 2**10, "params": MEMORY[policy] * 2**9},
        predicted_bytes={"total": MEMORY[policy] * 2**10},
        throughput={"steps_per_s": 100.0 + len(policy)},
        frozen_fraction={"all": 0.125 if policy == "bf16_pure" else 0.0},
        **kw,
    )


def make_judged() -> Judged:
    """The contract, records and decision the report tests share."""
    contract = Contract(
        workload="digits",
        size="tiny",
        candidates=tuple(GAPS),
        seeds=3,
        max_seeds=3,
        train={"steps": STEPS},
        step_caps={"amp_fp16": CAP},
    )
    records = []
    for seed in range(3):
        for policy in contract.policies:
            kw: dict[str, Any] = {}
            if policy == "bf16_pure":
                kw["doctor"] = FINDINGS
            if policy == "amp_fp16":
                kw["loss_scale_trace"] = [[0, 65536.0], [4, 32768.0]]
            records.append(_record(policy, seed, **kw))
    decision = decide(records, contract, higher_is_better=True)
    return Judged(contract, tuple(records), decision)
