"""The statistics behind the loss gate: paired gaps and their Student-t interval.

Runs that share a seed share their initial weights and batch order, so the
relevant noise of a candidate's gap is the spread of its per-seed *paired*
gaps, not the spread of absolute losses across seeds (which moves baseline and
candidate together). With the 2 to 5 seeds an experiment affords, a bootstrap
has too few distinct resamples to be trusted (and under-covers), so the interval
is the classic paired t-interval, which is exact when the gaps are normal and
robust to moderate departures.

The Student-t quantile is computed here (no SciPy at run time) from the
regularized incomplete beta function, evaluated by its continued fraction
(Abramowitz & Stegun 26.5.8 with Lentz's method), and inverted by bisection.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "GapInterval",
    "paired_interval",
    "seeds_to_decide",
    "student_t_cdf",
    "student_t_quantile",
]

_TINY = 1e-300
_EPS = 1e-15


def _beta_continued_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of I_x(a, b) (A&S 26.5.8), by the modified Lentz method."""
    c = 1.0
    d = 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > _TINY else _TINY)
    result = d
    for m in range(1, 1000):
        # Even step d_{2m}, then odd step d_{2m+1} of the fraction.
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1.0) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1.0)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > _TINY else _TINY)
            c = 1.0 + numerator / c
            c = c if abs(c) > _TINY else _TINY
            result *= c * d
        if abs(c * d - 1.0) < _EPS:
            break
    return result


def _regularized_beta(a: float, b: float, x: float) -> float:
    """I_x(a, b), the regularized incomplete beta function."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = (
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    )
    # The fraction converges fast for x < (a + 1) / (a + b + 2); use the symmetry otherwise.
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _beta_continued_fraction(a, b, x) / a
    return 1.0 - math.exp(log_front) * _beta_continued_fraction(b, a, 1.0 - x) / b


def student_t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with `df` degrees of freedom."""
    if not df > 0:
        raise ValueError(f"degrees of freedom must be > 0, got {df!r}")
    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    tail = 0.5 * _regularized_beta(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


@functools.cache  # pure, and asked for the same few (p, df) by every look at every gap
def student_t_quantile(p: float, df: float) -> float:
    """The `p` quantile of Student's t with `df` degrees of freedom (absolute error < 1e-9)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be in (0, 1), got {p!r}")
    if p < 0.5:
        return -student_t_quantile(1.0 - p, df)
    if p == 0.5:
        return 0.0
    lo, hi = 0.0, 1.0
    while student_t_cdf(hi, df) < p:
        lo, hi = hi, hi * 2.0
        if hi > 1e300:  # pragma: no cover - unreachable for p < 1
            return math.inf
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if student_t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-13 * max(1.0, hi):
            break
    return 0.5 * (lo + hi)


@dataclass(frozen=True, kw_only=True)
class GapInterval:
    """The mean of paired gaps and its two-sided Student-t confidence interval.

    Attributes:
        gaps: the per-seed paired gaps, in seed order.
        mean: their mean (NaN without gaps).
        low, high: the interval's bounds; -inf/+inf with a single gap (no spread
            can be estimated from one pair), NaN without gaps.
        confidence: the two-sided confidence level (e.g. 0.90).
        sd: the sample standard deviation of the gaps (NaN for fewer than 2).
    """

    gaps: tuple[float, ...]
    mean: float
    low: float
    high: float
    confidence: float
    sd: float

    @property
    def n(self) -> int:
        """How many paired gaps."""
        return len(self.gaps)


def paired_interval(gaps: Sequence[float], confidence: float) -> GapInterval:
    """The two-sided `confidence` t-interval of the mean of `gaps`.

    Non-finite gaps make the interval NaN (a diverged run has no gap to bound).
    """
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
    values = tuple(float(g) for g in gaps)
    n = len(values)
    if n == 0 or not all(math.isfinite(g) for g in values):
        mean = statistics.fmean(values) if n else math.nan
        return GapInterval(
            gaps=values, mean=mean, low=math.nan, high=math.nan, confidence=confidence, sd=math.nan
        )
    mean = statistics.fmean(values)
    if n == 1:
        return GapInterval(
            gaps=values,
            mean=mean,
            low=-math.inf,
            high=math.inf,
            confidence=confidence,
            sd=math.nan,
        )
    # Two passes in floats (statistics.stdev computes in exact fractions, 20x slower).
    sd = math.sqrt(math.fsum((g - mean) ** 2 for g in values) / (n - 1))
    half = student_t_quantile(0.5 + confidence / 2.0, n - 1) * sd / math.sqrt(n)
    return GapInterval(
        gaps=values, mean=mean, low=mean - half, high=mean + half, confidence=confidence, sd=sd
    )


def seeds_to_decide(gap: GapInterval, limit: float, *, most: int) -> int | None:
    """The fewest paired seeds (more than `gap.n`, at most `most`) whose interval would
    no longer contain `limit` if the gaps kept their mean and spread: the side the mean
    lies on decides (within: eligible, beyond: rejected). None when the gaps give no
    spread (fewer than 2, non-finite), the mean sits on the limit, or no count up to
    `most` would settle it.

    A projection, not a promise: new seeds bring a new mean and spread.
    """
    if gap.n < 2 or not (math.isfinite(gap.mean) and math.isfinite(gap.sd)):
        return None
    distance = abs(limit - gap.mean)
    if distance == 0:
        return None
    level = 0.5 + gap.confidence / 2.0
    for n in range(gap.n + 1, most + 1):
        if student_t_quantile(level, n - 1) * gap.sd / math.sqrt(n) < distance:
            return n
    return None
