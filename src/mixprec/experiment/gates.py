"""The quality gates a candidate must pass, and the training-length checks' defaults.

Plain data, part of a `mixprec.experiment.contract.Contract`; the verdicts
(`mixprec.experiment.verdicts`) read them. See docs/compare.md, "The decision".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["DEFAULT_MIN_IMPROVEMENT", "DEFAULT_TAIL_IMPROVEMENT", "Gates"]

#: The training-length checks' defaults (`Gates.min_improvement`,
#: `Gates.max_tail_improvement`). Fixed, not multiples of the gap limit: a limit
#: raised to what the data support once raised the trained-at-all floor with it and
#: turned "stay on fp32" into "too short to judge".
DEFAULT_MIN_IMPROVEMENT = 0.05
DEFAULT_TAIL_IMPROVEMENT = 0.0075


@dataclass(frozen=True, kw_only=True)
class Gates:
    """Quality gates a candidate must pass to be eligible.

    Attributes:
        max_rel_loss_gap: largest accepted relative held-out loss gap to the
            baseline, ``(candidate - baseline) / baseline`` for the same seed.
        confidence: two-sided confidence of the Student-t interval of the mean
            paired gap: eligible when the whole interval is at most
            `max_rel_loss_gap`, rejected when all of it is above, inconclusive
            otherwise. 0.90 makes each bound a one-sided 95% test (the two
            one-sided tests convention of equivalence testing).
        max_tail_improvement: long-enough check: the largest relative
            improvement of the baseline's held-out loss over the last fifth of
            the compared steps for the run to count as trained enough to judge a
            gap. None: `DEFAULT_TAIL_IMPROVEMENT` (0.75%), whatever the gap limit,
            so that moving the limit never moves this check.
        min_improvement: trained-at-all check: the least relative improvement of
            the baseline's held-out loss from its initial weights (step 0) to the
            compared step; a gap limit is meaningless next to a model that has
            barely moved. None: `DEFAULT_MIN_IMPROVEMENT` (5%), whatever the gap
            limit.
        metric_threshold: the held-out metric every seed must reach (at least this
            when higher is better, at most this when lower is better); None: no gate.
        max_nonfinite_steps: most steps with a non-finite loss allowed per run.
        max_skipped_fraction: largest fraction of skipped optimizer steps per run
            (loss-scale search included).
    """

    max_rel_loss_gap: float = 0.005
    confidence: float = 0.90
    max_tail_improvement: float | None = None
    min_improvement: float | None = None
    metric_threshold: float | None = None
    max_nonfinite_steps: int = 0
    max_skipped_fraction: float = 0.05

    def __post_init__(self) -> None:
        if not (_is_number(self.max_rel_loss_gap) and 0 <= self.max_rel_loss_gap < 1):
            raise ValueError(
                f"max_rel_loss_gap must be a fraction in [0, 1) (0.005 is 0.5%), got "
                f"{self.max_rel_loss_gap!r}"
            )
        if not (_is_number(self.confidence) and 0 < self.confidence < 1):
            raise ValueError(f"confidence must be in (0, 1) (e.g. 0.9), got {self.confidence!r}")
        for name in ("max_tail_improvement", "min_improvement"):
            value = getattr(self, name)
            if value is not None and not (_is_number(value) and 0 <= value < math.inf):
                raise ValueError(f"{name} must be a finite number >= 0 or null, got {value!r}")
        if self.metric_threshold is not None and not (
            _is_number(self.metric_threshold) and math.isfinite(self.metric_threshold)
        ):
            raise ValueError(
                f"metric_threshold must be a finite number or null, got {self.metric_threshold!r}"
            )
        if not (
            isinstance(self.max_nonfinite_steps, int)
            and not isinstance(self.max_nonfinite_steps, bool)
            and self.max_nonfinite_steps >= 0
        ):
            raise ValueError(
                f"max_nonfinite_steps must be an int >= 0, got {self.max_nonfinite_steps!r}"
            )
        if not (_is_number(self.max_skipped_fraction) and 0 <= self.max_skipped_fraction <= 1):
            raise ValueError(
                f"max_skipped_fraction must be in [0, 1], got {self.max_skipped_fraction!r}"
            )

    @property
    def improvement_floor(self) -> float:
        """The effective `min_improvement`."""
        if self.min_improvement is not None:
            return float(self.min_improvement)
        return DEFAULT_MIN_IMPROVEMENT

    @property
    def tail_limit(self) -> float:
        """The effective `max_tail_improvement`."""
        if self.max_tail_improvement is not None:
            return float(self.max_tail_improvement)
        return DEFAULT_TAIL_IMPROVEMENT


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and not math.isnan(value)
