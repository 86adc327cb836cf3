"""The objective's ranking: the policies in the running, best first, and whether the
step times' spread over seeds can change the choice.

Pure functions over policy summaries (`mixprec.experiment.decision` calls them):
`rank` orders the baseline and the eligible candidates by the contract's
objective, relative to the baseline; `steadiness` says whether the per-seed
step-time ranges could reorder them, and whether the first may be promoted.
See docs/compare.md, "Objectives and budgets".
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mixprec.experiment.stats import paired_interval
from mixprec.experiment.summary import PolicySummary

__all__ = ["TIE", "Standing", "rank", "span_of", "steadiness"]

#: Contenders whose objective figure is within this share of the best one are tied;
#: a tie goes to the objective's second figure (see `rank`).
TIE = 0.02


@dataclass(frozen=True, kw_only=True)
class Standing:
    """A policy in the running for the recommendation, and its figures relative to
    the baseline (the baseline's are 1 and 0).

    Attributes:
        policy: the policy.
        memory_ratio: measured memory over the baseline's (mean over paired seeds).
        time_ratio: step time over the baseline's (mean over paired seeds).
        gap: the mean paired held-out loss gap to the baseline.
        score: what the objective ranks, lower is better: `memory_ratio` (memory),
            `time_ratio` (speed) or their product (balanced); NaN when a figure is
            missing (such a policy cannot win).
    """

    policy: str
    memory_ratio: float
    time_ratio: float
    gap: float
    score: float

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return {
            "policy": self.policy,
            "memory_ratio": self.memory_ratio,
            "time_ratio": self.time_ratio,
            "gap": self.gap,
            "score": self.score,
        }


def _score(objective: str, memory_ratio: float, time_ratio: float) -> float:
    if objective == "memory":
        return memory_ratio
    if objective == "speed":
        return time_ratio
    return memory_ratio * time_ratio


def _second(objective: str, s: Standing) -> float:
    """What breaks a tie: speed for memory, memory for speed, the gap for balanced."""
    value = {"memory": s.time_ratio, "speed": s.memory_ratio}.get(objective, s.gap)
    return value if math.isfinite(value) else math.inf


def rank(summaries: Sequence[PolicySummary], objective: str, baseline: str) -> tuple[Standing, ...]:
    """`summaries` (the baseline among them, if it competes) best first under `objective`.

    The score is lower-is-better (`Standing.score`). Policies within `TIE` of the best
    score are tied and ordered by the objective's second figure (step time for
    ``memory``, memory for ``speed``, the gap for ``balanced``), then the baseline
    first (no change wins a complete tie), then in the given order; the others
    follow by score, and those without a score come last.
    """
    standings = []
    for s in summaries:
        is_base = s.policy == baseline
        memory = s.memory_ratio.mean
        time = s.time_ratio.mean
        standings.append(
            Standing(
                policy=s.policy,
                memory_ratio=memory,
                time_ratio=time,
                gap=0.0 if is_base else s.gap.mean,
                score=_score(objective, memory, time),
            )
        )
    scored = [st for st in standings if math.isfinite(st.score)]
    unscored = [st for st in standings if not math.isfinite(st.score)]
    if not scored:
        return tuple(unscored)
    best = min(st.score for st in scored)
    tied = [st for st in scored if st.score <= best * (1 + TIE)]
    rest = [st for st in scored if st not in tied]
    tied.sort(key=lambda st: (_second(objective, st), st.policy != baseline))
    rest.sort(key=lambda st: st.score)
    return (*tied, *rest, *unscored)


def steadiness(
    ranking: Sequence[Standing],
    by_name: Mapping[str, PolicySummary],
    objective: str,
    baseline: str,
    confidence: float,
) -> tuple[str, bool]:
    """Whether the step times' spread over seeds can change the choice of
    ``ranking[0]``, and whether it may be promoted.

    Each policy's step-time ratio is known to within the `confidence` t-interval of
    the mean of its per-seed ratios, taken on their logarithms so that it stays
    positive and narrows as seeds are added (`span_of`; the baseline's is 1). A rival
    is a policy that would beat the first, by more than the `TIE` band, at the fast
    end of its interval against the slow end of the first's. Returns a note naming
    the rivals and the intervals, empty without rivals, and whether the first may be
    recommended: the baseline always; a candidate only when the baseline is not a
    rival, so that speed the machine's load made up never promotes it.
    """

    def span(st: Standing) -> tuple[float, float]:
        if st.policy == baseline:
            return 1.0, 1.0
        return span_of(by_name[st.policy].time_ratio.values, confidence)

    first = ranking[0]
    worst = _score(objective, first.memory_ratio, span(first)[1])
    rivals = [
        st
        for st in ranking[1:]
        if _score(objective, st.memory_ratio, span(st)[0]) * (1 + TIE) < worst
    ]
    if not rivals:
        return "", True
    base = next((st for st in rivals if st.policy == baseline), None)
    promote = base is None
    ranges = ", ".join(
        f"{st.policy} {lo:.2f}-{hi:.2f}x"
        for st in (first, *rivals)
        if st.policy != baseline
        for lo, hi in [span(st)]
    )
    note = (
        f"step-time ratios varied over seeds ({confidence:.0%} intervals of their means: "
        f"{ranges}): within them {', '.join(st.policy for st in rivals)} would score "
        f"better than {first.policy}, so another draw of the same runs can choose differently"
    )
    if base is not None:
        note += (
            f"; {first.policy} is not promoted on speed alone (at the slow end, "
            f"{span(first)[1]:.2f}x, it scores {worst:.3f} against {baseline}'s "
            f"{base.score:.3f})"
        )
    return note + "; measure on a quiet machine (or objective memory) to choose on speed", promote


def span_of(ratios: Sequence[float], confidence: float) -> tuple[float, float]:
    """The two-sided `confidence` t-interval of the mean of per-seed `ratios`, on
    their logarithms (a ratio's noise is a factor); one ratio is its own interval,
    a non-positive or non-finite one makes it NaN."""
    if not ratios or not all(math.isfinite(r) and r > 0 for r in ratios):
        return math.nan, math.nan
    if len(ratios) == 1:
        return ratios[0], ratios[0]
    interval = paired_interval([math.log(r) for r in ratios], confidence)
    return math.exp(interval.low), math.exp(interval.high)
