"""The report's sentences: verdicts, the headline, the gates line, what the data show.

Every sentence is written here once, from the decision, the records and the
contract; the view model (`mixprec.experiment.report.view`) holds them and each
renderer only formats them. Sentences may carry Markdown's inline markers (double
asterisks for strong text, backticks for code): report.md keeps them, report.html
drops them and keeps the words.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from mixprec.experiment.contract import Contract, format_bytes
from mixprec.experiment.decision import Decision
from mixprec.experiment.fp8_gate import SPEED_PENDING
from mixprec.experiment.optimizer import DEFAULT_OPTIMIZER
from mixprec.experiment.ranking import TIE, Standing
from mixprec.experiment.records import RunRecord
from mixprec.experiment.summary import Ratio, format_interval, tail_start

__all__ = [
    "OBJECTIVE_WORDS",
    "choice_lines",
    "gates_sentence",
    "hardware_sentence",
    "headline",
    "loss_scale_moved",
    "memory_saved_cell",
    "objective_sentence",
    "observations",
    "step_time_cell",
    "verdict_label",
    "verdict_reason",
]

_STATUS_WORDS = {
    "eligible": "eligible",
    "rejected": "rejected",
    "inconclusive": "inconclusive",
    "too_short": "too short to judge",
    "not_run": "not run",
}


def verdict_label(name: str, decision: Decision) -> str:
    """A short verdict: ``RECOMMENDED``, ``eligible``, ``rejected (gate)``, ``inconclusive``..."""
    if name == decision.baseline:
        if not decision.baseline_ok:
            return "baseline FAILED"
        if decision.too_short:
            return "baseline (too short to judge)"
        return "baseline, RECOMMENDED (stay)" if name == decision.recommended else "baseline"
    if name == decision.recommended:
        return "RECOMMENDED"
    v = decision.verdicts.get(name)
    if v is None:
        return "?"
    word = _STATUS_WORDS[v.status]
    if v.status == "eligible" and decision.status == "pending_target":
        return "eligible, pending target"
    if v.status == "eligible" and name in decision.speed_pending:
        return "eligible, speed pending FP8 hardware"
    return f"{word} ({v.gate})" if v.status == "rejected" else word


def verdict_reason(name: str, decision: Decision) -> str:
    """The sentence behind the verdict, with acknowledged doctor rules."""
    if name == decision.baseline:
        if not decision.baseline_ok:
            return decision.baseline_reason
        return decision.too_short or decision.baseline_note
    v = decision.verdicts.get(name)
    if v is None:
        return ""
    note = decision.notes.get(name, "")
    return v.reason + (f"; {note}" if note else "")


#: What each objective recommends, completing "the ... among the baseline and the
#: eligible candidates".
OBJECTIVE_WORDS = {
    "memory": "least measured memory",
    "speed": "shortest measured step time",
    "balanced": "least product of memory and step time relative to the baseline",
}


def headline(decision: Decision) -> str:
    """The recommendation, or why there is none, for the optimizer the runs trained
    with when it is not the default AdamW; then what a rerun needs to decide what is
    left open (`rerun_sentence`)."""
    rerun = rerun_sentence(decision)
    first = _headline(decision)
    if decision.optimizer != DEFAULT_OPTIMIZER:
        first = f"With optimizer {decision.optimizer}: {first}"
    if not rerun:
        return first
    return f"{first}{'' if first.endswith('.') else '.'} {rerun}"


def rerun_sentence(decision: Decision) -> str:
    """``To decide X, rerun into the same --out with --max-seeds 9 (stored runs are
    reused).``, from `Decision.decide_with`, or empty when nothing is left open."""
    wanted = decision.decide_with
    flags = [
        f"--policies {','.join(value)}"
        if key == "candidates"
        else f"--{key.replace('_', '-')} {value}"
        for key, value in wanted.items()
        if key != "step_caps"
    ]
    if "step_caps" in wanted:  # no flag: a contract file says it
        flags.append(("and " if flags else "") + "step_caps: {} in a --config file")
    if not flags:
        return ""
    # Other steps or caps are other runs; more seeds add to the stored ones.
    reused = "" if {"steps", "step_caps"} & set(wanted) else " (stored runs are reused)"
    open_ = [n for n, v in decision.verdicts.items() if v.decide_with]
    what = "" if decision.too_short or not open_ else f" {', '.join(open_)}"
    others = (
        "; the other candidates' verdicts stand as judged here" if "candidates" in wanted else ""
    )
    return f"To decide{what}, rerun into the same --out with {' '.join(flags)}{reused}{others}."


def _headline(decision: Decision) -> str:
    if not decision.baseline_ok:
        return f"The baseline failed its own gates: {decision.baseline_reason}"
    if decision.incomplete:
        return f"No recommendation, the experiment is incomplete: {decision.incomplete}."
    if decision.too_short:
        return f"No recommendation, too short to judge: {decision.too_short}."
    why = f"objective {decision.objective}: the {OBJECTIVE_WORDS[decision.objective]}"
    fp8 = (
        f". Eligible on quality, {SPEED_PENDING}: {', '.join(decision.speed_pending)}"
        if decision.speed_pending
        else ""
    )
    if decision.status == "stay" and not decision.eligible:
        pending = ", ".join(decision.inconclusive)
        open_ = f"; inconclusive: {pending}" if pending else ""
        return (
            f"Recommended: stay on **{decision.baseline}** (no candidate passed the gates{open_})"
        )
    if decision.status == "stay" and decision.ranking[0].policy != decision.baseline:
        lead = decision.ranking[0].policy
        return (
            f"Recommended: stay on **{decision.baseline}** ({why}; `{lead}` leads on the means "
            f"only on step times that varied over seeds, see the choice below){fp8}"
        )
    if decision.status == "stay":
        return (
            f"Recommended: stay on **{decision.baseline}** ({why}; no eligible candidate beats "
            f"it, see the choice below){fp8}"
        )
    if decision.recommended:
        return f"Recommended: **{decision.recommended}** ({why}; see the choice below){fp8}"
    if decision.status == "pending_target":
        return (
            f"Pending a run on the target {decision.target_device}: nothing is promoted. "
            f"Eligible on quality here: {', '.join(decision.eligible)}; "
            f"{decision.pending}."
        )
    if decision.eligible and decision.speed_note:
        return f"No recommendation: {decision.speed_note}."
    if decision.inconclusive:
        return (
            "No recommendation: no candidate is settled within the gap limit "
            f"(inconclusive: {', '.join(decision.inconclusive)}, "
            f"after up to {decision.max_seeds} seeds)."
        )
    return "No candidate passed the gates."


def _baseline_speed(decision: Decision) -> str:
    """The baseline's own steps/s, labelled as its (the one absolute speed the report
    gives: every other speed is a step-time ratio paired per seed), or empty."""
    base = next((s for s in decision.summaries if s.policy == decision.baseline), None)
    if base is None or not math.isfinite(base.steps_per_s):
        return ""
    n = len(base.heldout_losses)
    return (
        f"; {base.policy} (the baseline) trained at {base.steps_per_s:.3g} steps/s "
        f"(mean of {n} seed{'s' if n != 1 else ''})"
    )


def hardware_sentence(decision: Decision) -> str:
    """Where the runs were measured (CPU model and flags or GPU, torch, threads) and
    the baseline's own steps/s there, and whether that is the target."""
    facts = decision.hardware
    if not facts:
        where = "Measured on: nothing yet (no run finished)"
    elif len(facts) == 1:
        only = facts[0]
        where = "Measured on " + (
            only.describe() if only else "hardware not recorded (records of an earlier mixprec)"
        )
    else:
        where = f"Measured on {len(facts)} setups: " + "; ".join(
            f.describe() if f else "hardware not recorded" for f in facts
        )
    if facts:
        where += _baseline_speed(decision)
    target = decision.target_device
    if target is None:
        return f"{where}."
    if decision.pending:
        return f"{where}. Target: {target}, not where these runs were measured."
    return f"{where}. Target: {target}, where these runs were measured."


_FIGURE = {"memory": "memory", "speed": "step time", "balanced": "memory x step time"}
_SECOND = {
    "memory": "the shorter step time",
    "speed": "the smaller memory",
    "balanced": "the smaller loss gap",
}


def objective_sentence(decision: Decision) -> str:
    """The objective and the budgets the recommendation is made under."""
    parts = [
        f"Objective: {decision.objective}, the {OBJECTIVE_WORDS[decision.objective]} "
        f"(within {TIE:.0%} of the best, {_SECOND[decision.objective]} decides)"
    ]
    if decision.memory_budget is not None:
        parts.append(f"memory_budget {format_bytes(decision.memory_budget)}")
    if decision.max_slowdown is not None:
        judged = "" if not decision.speed_note else " (not judged: " + decision.speed_note + ")"
        if decision.emulated and not decision.speed_note:
            judged = (
                f" (not judged for {', '.join(decision.emulated)}: emulated FP8 step times "
                "measure numerics, not speed)"
            )
        parts.append(f"max_slowdown {decision.max_slowdown:.2f}x {decision.baseline}{judged}")
    return "; ".join(parts) + "."


def memory_saved_cell(ratio: Ratio, is_baseline: bool) -> str:
    """``41.2%`` saved against the baseline, with the range over seeds when it varies."""
    if is_baseline:
        return "reference" if ratio.values else "-"
    if not math.isfinite(ratio.mean):
        return "-"
    cell = f"{1 - ratio.mean:.1%}"
    low, high = f"{1 - ratio.high:.1%}", f"{1 - ratio.low:.1%}"
    return cell if low == high else f"{cell} ({low} to {high})"


def step_time_cell(ratio: Ratio, is_baseline: bool) -> str:
    """``2.12x`` the baseline's step time, with the range over seeds when it varies."""
    if is_baseline:
        return "reference" if ratio.values else "-"
    if not math.isfinite(ratio.mean):
        return "-"
    cell = f"{ratio.mean:.2f}x"
    low, high = f"{ratio.low:.2f}", f"{ratio.high:.2f}"
    return cell if low == high else f"{cell} ({low}-{high})"


def _standing_line(st: Standing, objective: str, baseline: str) -> str:
    m, t = f"{st.memory_ratio:.3f}", f"{st.time_ratio:.3f}"
    if objective == "balanced":
        return f"`{st.policy}`: memory {m} x step time {t} = {st.score:.3f}"
    if objective == "speed":
        return f"`{st.policy}`: step time {t} of {baseline}'s (memory {m})"
    return f"`{st.policy}`: memory {m} of {baseline}'s (step time {t})"


def choice_lines(decision: Decision) -> tuple[str, ...]:
    """How the recommendation was made: the rule, each contender's figures relative
    to the baseline (best first; the balanced product written out), the outcome."""
    if not decision.ranking:
        return ()
    base = decision.baseline
    objective = decision.ranked_by
    by_memory = objective != decision.objective
    among = f"{base} and the eligible candidates"
    if decision.baseline_note:
        among = f"the eligible candidates ({base} excluded: {decision.baseline_note})"
    if by_memory:
        rule = (
            f"Ranked by measured memory alone, relative to {base}: {decision.speed_note}; "
            f"among {among}:"
        )
    else:
        rule = (
            f"Objective {objective}: among {among}, the least {_FIGURE[objective]}, each "
            f"relative to {base}; within {TIE:.0%} of the best, {_SECOND[objective]} decides:"
        )
    lines = [rule] + [_standing_line(st, objective, base) for st in decision.ranking]
    first = decision.ranking[0]
    if decision.recommended is not None and decision.recommended != first.policy:
        # The first on the mean is not promoted: its lead rests on unsteady step times.
        lines.append(
            f"Chosen: stay on `{decision.recommended}`; `{first.policy}` leads at "
            f"{first.score:.3f} only on step times that varied over seeds (below)."
        )
    elif decision.recommended is not None:
        verb = "stay on" if decision.status == "stay" else "promote"
        runner_up = ""
        if len(decision.ranking) > 1:
            second = decision.ranking[1]
            runner_up = f", next `{second.policy}` at {second.score:.3f}"
            best = min(first.score, second.score)
            if max(first.score, second.score) <= best * (1 + TIE):
                runner_up += f" (tied within {TIE:.0%}: {_SECOND[objective]} decided)"
        lines.append(f"Chosen: {verb} `{first.policy}` at {first.score:.3f}{runner_up}.")
    elif decision.status == "pending_target":
        lines.append(
            f"Nothing is promoted: rerun this contract on {decision.target_device} to rank by "
            f"{decision.objective}."
        )
    elif not by_memory and decision.speed_note:
        lines.append(f"Nothing is recommended: {decision.speed_note}.")
    if decision.speed_pending:
        lines.append(
            f"Left out of this ranking: {', '.join(f'`{n}`' for n in decision.speed_pending)}, "
            f"eligible, {SPEED_PENDING}: their step times were measured under torchao's FP8 "
            "emulation, which measures numerics, not speed. Rerun this contract there to rank "
            f"them by {decision.objective}."
        )
    elif objective == "memory" and len(decision.ranking) > 1:
        first, second = decision.ranking[:2]
        tied = max(first.score, second.score) <= min(first.score, second.score) * (1 + TIE)
        emulated = [st.policy for st in (first, second) if st.policy in decision.emulated]
        if tied and emulated:
            lines.append(
                f"The tie was broken on step times of {', '.join(f'`{n}`' for n in emulated)} "
                "measured under FP8 emulation: they measure emulation overhead, not FP8 speed."
            )
    if decision.unsteady:
        lines.append(f"Step times were unsteady: {decision.unsteady}.")
    return tuple(lines)


def gates_sentence(contract: Contract, metric_name: str) -> str:
    """The gates every candidate is judged by, as one sentence (without the final period)."""
    gates = contract.gates
    return (
        f"held-out loss gap per seed, paired with {contract.baseline}: eligible when its "
        f"{gates.confidence:.0%} t-interval lies at or below {gates.max_rel_loss_gap:.2%} at "
        f"max_seeds={contract.seed_limit} seeds (one look), rejected when above at any count, "
        "inconclusive otherwise; judged only when "
        f"{contract.baseline} improved >= {gates.improvement_floor:.2%} from step 0 and, for "
        f"runs shorter than the workload's schedule, its last fifth <= {gates.tail_limit:.2%}; "
        "doctor errors on the update path reject"
        + (f" (acknowledged: {', '.join(contract.allow)})" if contract.allow else "")
        + f"; non-finite-loss steps <= {gates.max_nonfinite_steps}; skipped steps <= "
        f"{gates.max_skipped_fraction:.0%}"
        + (
            f"; {metric_name} threshold {gates.metric_threshold:g}"
            if gates.metric_threshold is not None
            else ""
        )
    )


def observations(records: Sequence[RunRecord], decision: Decision) -> list[str]:
    """Plain statements read off the data; nothing here is asserted without it."""
    notes: list[str] = []
    if decision.fp8_reference is not None:
        notes.append(
            f"FP8 candidates were judged against `{decision.fp8_reference}` too (gate "
            "fp8-reference): FP8 must hold the quality of the 16-bit policy it would replace"
        )
    elif decision.fp8_note:
        notes.append(f"FP8 candidates were not judged: {decision.fp8_note}")
    base = decision.summaries[0] if decision.summaries else None
    if base is not None and math.isfinite(base.baseline_spread):
        notes.append(
            f"`{base.policy}` (the baseline) reached a held-out loss of {base.heldout_loss:.4f} "
            f"(mean of its {len(base.heldout_losses)} seeds), varying by "
            f"{base.baseline_spread:.2%} (relative sd) over them; gaps are judged per seed, "
            "paired on the same weights and batches, so this spread is not the noise of a gap"
        )
    if base is not None and math.isfinite(base.tail_improvement):
        notes.append(
            f"`{base.policy}` improved {base.tail_improvement:.2%} over its last fifth "
            f"(steps {tail_start(base.steps)}-{base.steps})"
        )
    for s in decision.summaries[1:]:
        if base is None or not math.isfinite(s.rel_gap):
            continue
        where = "" if s.steps == base.steps else f" at step {s.steps}"
        notes.append(
            f"`{s.policy}`: paired gap {format_interval(s.gap)} vs `{base.policy}`{where} over "
            f"{s.gap.n} seed(s); {s.frozen_fraction:.1%} of parameter elements never changed"
        )
    capped = sorted(
        {
            (r.policy, r.steps, r.schedule_steps)
            for r in records
            if r.schedule_steps and r.steps < r.schedule_steps
        }
    )
    for policy, steps, total in capped:
        notes.append(
            f"`{policy}` ran {steps} of {total} steps (same learning-rate schedule) and is "
            f"compared with `{decision.baseline}` after step {steps}"
        )
    reasons: dict[str, list[str]] = {}
    for r in records:
        eff = r.effective
        if eff and not eff.get("compute_fast", True):
            names = reasons.setdefault(str(eff.get("reason", "not accelerated here")), [])
            if r.policy not in names:
                names.append(r.policy)
    for reason, names in reasons.items():
        notes.append(f"{', '.join(f'`{n}`' for n in names)}: {reason}")
    for policy, moved in loss_scale_moved(records).items():
        if not moved:
            scales = sorted(
                {p[1] for r in records if r.policy == policy for p in r.loss_scale_trace}
            )
            at = f"at {scales[0]:g}" if len(scales) == 1 else "at its initial value"
            notes.append(
                f"`{policy}`: loss scale stayed {at} in every run (no overflow skipped a "
                "step, none grew it), so it has no loss-scale plot"
            )
    for r in records:
        if r.frozen_fraction.get("norm", 0) > 0.5 and r.seed == 0:
            notes.append(
                f"`{r.policy}`: {r.frozen_fraction['norm']:.1%} of norm-layer parameters "
                "never left their initial value"
            )
    return notes


def loss_scale_moved(records: Sequence[RunRecord]) -> dict[str, bool]:
    """Each policy that traced a loss scale, and whether its scale moved in any run
    (the loss-scale plot draws only those; a flat trace says no more than a sentence)."""
    moved: dict[str, bool] = {}
    for r in records:
        if r.loss_scale_trace:
            values = {p[1] for p in r.loss_scale_trace}
            moved[r.policy] = moved.get(r.policy, False) or len(values) > 1
    return moved
