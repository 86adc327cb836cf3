"""The FP8 gate: an FP8 candidate is judged against the best 16-bit policy too.

FP8 is the step after bf16, not after fp32: its narrow range and 2-3 mantissa
bits only pay when the 16-bit policy it would replace is measured, passes the
gates, and FP8 holds its quality. So an FP8 candidate (a run whose policy has
`fp8` settings) must pass every gate against the baseline, like any candidate,
and then its paired held-out gap to a 16-bit reference must be within the same
``max_rel_loss_gap``. The reference is the contract's `baseline_for_fp8`, or by
default the best eligible 16-bit candidate under the objective (the one the
decision would recommend among 16-bit policies). With no eligible 16-bit
candidate, FP8 is not judged: nothing says what it would replace.

An FP8 candidate that ran emulated (its records' ``effective.fp8.emulate``: every
CPU, and GPUs below CUDA capability 8.9) has step times that measure torchao's
emulation, not FP8 speed: `emulated_fp8` names them, and the decision neither
ranks them on step time nor rejects them by ``max_slowdown`` (`SPEED_PENDING`).

An FP8 candidate whose conversion converted no layer (its records'
``effective.fp8.converted`` is empty: every `nn.Linear` kept by the fp8 filter) trained
entirely in 16 bits: `unconverted_fp8` names it, and it is not emulated FP8, so its
step times are ranked as measured. It stays an FP8 candidate for the gate (it is the
policy the user named, and on a model where its filter converts layers it is FP8), so
it is never the 16-bit reference of the others.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from mixprec.experiment.contract import Contract
from mixprec.experiment.records import RunRecord
from mixprec.experiment.summary import summarize
from mixprec.experiment.verdicts import Verdict, gap_verdict

__all__ = [
    "FP8_GATE",
    "SPEED_PENDING",
    "emulated_fp8",
    "fp8_policies",
    "judge_fp8",
    "reference_for_fp8",
    "unconverted_fp8",
]

#: The gate name of a verdict decided against the 16-bit reference.
FP8_GATE = "fp8-reference"

#: What an eligible FP8 candidate that ran emulated is, under a speed objective.
SPEED_PENDING = "speed pending a run on FP8 hardware (CUDA capability 8.9+)"


def fp8_policies(records: Sequence[RunRecord], names: Sequence[str]) -> tuple[str, ...]:
    """The policies among `names` whose runs trained with FP8 linears (their
    recorded policy fields hold `fp8` settings)."""
    fp8 = {r.policy for r in records if r.policy_fields.get("fp8")}
    return tuple(n for n in names if n in fp8)


def _conversion(r: RunRecord) -> Mapping[str, object] | None:
    fp8 = r.effective.get("fp8") if r.ok else None
    return fp8 if isinstance(fp8, Mapping) else None


def _converted_none(fp8: Mapping[str, object]) -> bool:
    """Whether a recorded conversion converted no layer (records of an earlier mixprec
    without ``converted`` count as converting)."""
    converted = fp8.get("converted")
    return isinstance(converted, list | tuple) and not converted


def unconverted_fp8(records: Sequence[RunRecord], names: Sequence[str]) -> tuple[str, ...]:
    """The FP8 policies among `names` whose finished runs all converted no layer
    (``effective.fp8.converted`` empty): they trained entirely in 16 bits."""
    runs: dict[str, list[bool]] = {}
    for r in records:
        fp8 = _conversion(r)
        if fp8 is not None:
            runs.setdefault(r.policy, []).append(_converted_none(fp8))
    return tuple(n for n in names if runs.get(n) and all(runs[n]))


def emulated_fp8(records: Sequence[RunRecord], names: Sequence[str]) -> tuple[str, ...]:
    """The policies among `names` with a finished run whose FP8 linears ran emulated
    (``effective.fp8.emulate`` of its record, with a layer converted): their step times
    measure numerics, not speed."""
    emulated = set()
    for r in records:
        fp8 = _conversion(r)
        if fp8 is not None and fp8.get("emulate") is True and not _converted_none(fp8):
            emulated.add(r.policy)
    return tuple(n for n in names if n in emulated)


def reference_for_fp8(
    contract: Contract,
    verdicts: dict[str, Verdict],
    ranked_16bit: Sequence[str],
    fp8: Sequence[str] = (),
) -> tuple[str | None, str]:
    """The 16-bit policy FP8 candidates are judged against, or None and why.

    Args:
        contract: the contract (its `baseline_for_fp8`, when set, is the reference).
        verdicts: every candidate's verdict against the baseline.
        ranked_16bit: the eligible 16-bit candidates, best first under the objective.
        fp8: the FP8 candidates (the others are the 16-bit ones).
    """
    named = contract.baseline_for_fp8
    if named is not None:
        v = verdicts.get(named)
        if v is None or v.status != "eligible":
            status = "not judged" if v is None else f"{v.status} ({v.reason})"
            return None, f"baseline_for_fp8 {named} is {status}"
        return named, ""
    if not ranked_16bit:
        sixteen = [n for n in contract.candidates if n not in fp8 and n in verdicts]
        if not sixteen:
            return None, (
                "the contract has no 16-bit candidate: FP8 is judged against the best 16-bit "
                "policy it would replace; add amp_bf16 or bf16_master to the candidates"
            )
        how = ", ".join(f"{n} {verdicts[n].status}" for n in sixteen)
        return None, (
            f"no 16-bit candidate passed the gates ({how}): FP8 is judged against the best "
            "16-bit policy it would replace"
        )
    return ranked_16bit[0], ""


def judge_fp8(
    name: str,
    verdict: Verdict,
    records: Sequence[RunRecord],
    reference: str | None,
    why_none: str,
    contract: Contract,
) -> Verdict:
    """`verdict` (against the baseline) of FP8 candidate `name`, then judged against
    the 16-bit `reference` when it passed."""
    if verdict.status != "eligible":
        return verdict
    if reference is None:
        return Verdict(
            status="rejected",
            gate=FP8_GATE,
            reason=f"not judged against a 16-bit policy: {why_none}",
            acknowledged=verdict.acknowledged,
        )
    gates = contract.gates
    ref_records = [r for r in records if r.policy == reference]
    s = summarize(records, name, ref_records, confidence=gates.confidence)
    if s.gap.n == 0:
        return Verdict(
            status="not_run",
            gate=FP8_GATE,
            reason=f"no seed shared with {reference} to pair with: rerun compare",
            acknowledged=verdict.acknowledged,
        )
    against = gap_verdict(
        s.gap,
        gates.max_rel_loss_gap,
        seed_limit=contract.seed_limit,
        acknowledged=verdict.acknowledged,
        gate=FP8_GATE,
        against=reference,
    )
    return Verdict(
        status=against.status,
        gate=FP8_GATE,
        reason=f"{against.reason} (against {contract.baseline}: {verdict.reason})",
        acknowledged=verdict.acknowledged,
    )
