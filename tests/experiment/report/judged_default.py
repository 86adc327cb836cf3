"""The default compare (fp32 and the six default candidates) judged from constructed
records (no training), shaped like the run issue 31 reported: the candidates ran
different seed counts (extra seeds for an inconclusive one), the machine's load
changed between seeds (bf16_lean's third to fifth seeds and fp32's on them ran 20x
slower), fp16 policies were capped, and the doctor said the same note on every policy."""

from __future__ import annotations

from typing import Any

from mixprec.experiment import Contract, RunRecord, decide
from mixprec.experiment.contract import DEFAULT_CANDIDATES
from mixprec.experiment.summary import tail_start

from .judged import Judged

STEPS = 500
CAP = 100
#: fp32's held-out loss per seed.
BASE = [1.50, 1.46, 1.53, 1.49, 1.51]
#: Paired relative gaps per seed; a candidate runs as many seeds as it has gaps.
GAPS = {
    "amp_bf16": [0.001, 0.002],
    "bf16_master": [0.0015, 0.002, 0.001],
    "bf16_lean": [0.004, 0.009, -0.002, 0.006, 0.001],
    "bf16_pure": [0.121, 0.134],
    "amp_fp16": [0.0005, 0.001],
    "fp16_unscaled": [0.0, 0.0],
}
MEMORY_KIB = {
    "fp32": 40000,
    "amp_bf16": 39000,
    "bf16_master": 25000,
    "bf16_lean": 15000,
    "bf16_pure": 12000,
    "amp_fp16": 38000,
    "fp16_unscaled": 38000,
}
#: Steps per second on a quiet machine; seeds 2-4 ran under load, 20 times slower.
SPEED = {
    "fp32": 60.0,
    "amp_bf16": 52.0,
    "bf16_master": 48.0,
    "bf16_lean": 25.0,
    "bf16_pure": 30.0,
    "amp_fp16": 8.0,
    "fp16_unscaled": 8.0,
}
LOADED_SEEDS = (2, 3, 4)
#: A note the doctor makes on every policy, and one it makes on one policy.
SHARED_NOTE = {
    "rule": "eval-dtype",
    "severity": "info",
    "where": "evaluation",
    "message": "held-out loss is computed under the policy's autocast",
    "fix": "nothing to do; evaluate in fp32 to compare absolute losses",
}
OWN_NOTE = {
    "rule": "vanishing-updates",
    "severity": "warning",
    "where": "optimizer",
    "message": "3.1% of updates rounded away",
    "fix": "keep an fp32 master",
}


def _record(policy: str, seed: int) -> RunRecord:
    base = BASE[seed]
    capped = policy in ("amp_fp16", "fp16_unscaled")
    steps = CAP if capped else STEPS
    loss = base * (1 + GAPS[policy][seed]) if policy in GAPS else base
    if policy == "fp32":
        curve = [[0, 2 * base], [tail_start(CAP), base * 1.001], [CAP, base]]
        curve += [[tail_start(STEPS), base * 1.001], [STEPS, base]]
    else:
        curve = [[0, 2 * loss], [tail_start(steps), loss * 1.001], [steps, loss]]
    speed = SPEED[policy] / (20 if seed in LOADED_SEEDS else 1)
    kw: dict[str, Any] = {}
    if policy == "fp16_unscaled":
        kw["nonfinite_steps"] = 7
    if policy == "amp_fp16":
        kw["loss_scale_trace"] = [[0, 65536.0], [40, 32768.0]]
        kw["policy_fields"] = {"loss_scaling": {"init_scale": 65536.0}}
    doctor = [SHARED_NOTE]
    if policy == "bf16_lean":  # each seed measures its own share: the first one is shown
        doctor.append({**OWN_NOTE, "message": f"{3.1 + seed / 10:.1f}% of updates rounded away"})
    return RunRecord(
        workload="shakespeare",
        size="compare",
        policy=policy,
        policy_fields=kw.pop("policy_fields", {"loss_scaling": None}),
        seed=seed,
        steps=steps,
        schedule_steps=STEPS,
        fingerprint="f",
        heldout_loss=loss,
        metric=loss / 0.693,
        metric_name="bits_per_char",
        loss_curve=[[i, 3.0 - 1.5 * i / STEPS] for i in range(0, steps, 5)],
        eval_curve=curve,
        bytes={"total": MEMORY_KIB[policy] * 2**10, "params": MEMORY_KIB[policy] * 2**8},
        predicted_bytes={"total": MEMORY_KIB[policy] * 2**10},
        throughput={"steps_per_s": speed},
        frozen_fraction={"all": 0.0},
        doctor=tuple(doctor),
        **kw,
    )


def make_default_judged() -> Judged:
    """The default 7-policy compare, judged (see the module's docstring)."""
    contract = Contract(
        workload="shakespeare",
        size="compare",
        candidates=DEFAULT_CANDIDATES,
        seeds=2,
        max_seeds=5,
        train={"steps": STEPS},
        step_caps={"amp_fp16": CAP, "fp16_unscaled": CAP},
    )
    records = [_record("fp32", seed) for seed in range(len(BASE))]
    records += [
        _record(policy, seed) for policy in DEFAULT_CANDIDATES for seed in range(len(GAPS[policy]))
    ]
    decision = decide(records, contract, higher_is_better=False)
    return Judged(contract, tuple(records), decision)
