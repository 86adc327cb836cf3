"""The Student-t quantile and the paired interval, against published tables and SciPy."""

from __future__ import annotations

import math
import statistics

import pytest

from mixprec.experiment.stats import paired_interval, student_t_cdf, student_t_quantile

#: (p, df, quantile) from standard two-tailed t tables (4 decimals as printed).
T_TABLE: tuple[tuple[float, int, float], ...] = (
    (0.95, 1, 6.3138),
    (0.95, 2, 2.9200),
    (0.95, 3, 2.3534),
    (0.95, 4, 2.1318),
    (0.95, 10, 1.8125),
    (0.975, 1, 12.7062),
    (0.975, 4, 2.7764),
    (0.975, 30, 2.0423),
    (0.995, 5, 4.0321),
    (0.9, 2, 1.8856),
)
TABLE_TOLERANCE = 6e-5  # the tables print 4 decimals


@pytest.mark.parametrize(("p", "df", "expected"), T_TABLE)
def test_quantile_matches_tables(p: float, df: int, expected: float) -> None:
    assert student_t_quantile(p, df) == pytest.approx(expected, abs=TABLE_TOLERANCE)
    assert student_t_quantile(1 - p, df) == pytest.approx(-expected, abs=TABLE_TOLERANCE)


def test_closed_forms() -> None:
    # df = 1 is the Cauchy distribution; df = 2 has F(t) = 1/2 + t / (2 sqrt(t^2 + 2)).
    for p in (0.6, 0.9, 0.99, 0.999):
        assert student_t_quantile(p, 1) == pytest.approx(math.tan(math.pi * (p - 0.5)), rel=1e-9)
    for t in (-5.0, -0.3, 0.0, 0.7, 3.0, 40.0):
        assert student_t_cdf(t, 2) == pytest.approx(0.5 + t / (2 * math.sqrt(t * t + 2)), abs=1e-12)
    # Large df tends to the normal distribution.
    z = statistics.NormalDist().inv_cdf(0.975)
    assert student_t_quantile(0.975, 10**6) == pytest.approx(z, abs=1e-5)


def test_against_scipy_when_available() -> None:
    stats = pytest.importorskip("scipy.stats")
    for df in (1, 2, 3, 4, 7, 30, 200):
        for p in (0.55, 0.8, 0.95, 0.975, 0.995, 0.9999):
            assert student_t_quantile(p, df) == pytest.approx(stats.t.ppf(p, df), rel=1e-9)
        for t in (-12.0, -1.5, 0.2, 2.5, 9.0):
            assert student_t_cdf(t, df) == pytest.approx(stats.t.cdf(t, df), abs=1e-12)


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError, match="p must be in"):
        student_t_quantile(1.0, 3)
    with pytest.raises(ValueError, match="degrees of freedom"):
        student_t_cdf(1.0, 0)
    with pytest.raises(ValueError, match="confidence must be in"):
        paired_interval([0.1, 0.2], 0.0)


def test_paired_interval() -> None:
    gaps = [0.062, 0.061, 0.019]
    i = paired_interval(gaps, 0.90)
    half = 2.919986 * statistics.stdev(gaps) / math.sqrt(3)
    assert i.mean == pytest.approx(statistics.fmean(gaps))
    assert (i.low, i.high) == pytest.approx((i.mean - half, i.mean + half), rel=1e-6)
    assert i.n == 3 and i.gaps == tuple(gaps)
    same = paired_interval([0.01, 0.01], 0.9)
    assert same.low == same.high == pytest.approx(0.01)
    one = paired_interval([0.01], 0.9)
    assert one.low == -math.inf and one.high == math.inf and one.mean == 0.01
    none = paired_interval([], 0.9)
    assert none.n == 0 and math.isnan(none.mean) and math.isnan(none.high)
    diverged = paired_interval([0.01, math.inf], 0.9)
    assert math.isnan(diverged.low) and math.isnan(diverged.high)
