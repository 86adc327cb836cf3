"""Which steps the probe samples: a step-count floor and a time budget.

A sampled step costs the probe a fixed amount of work per gradient element, so
its share of the step time grows as steps get faster: a period in steps alone
that costs 3% on one CPU costs 20% on one eight times faster. `SampleSchedule`
therefore samples by time, as a token bucket: every second of the run's own
time (the clock's time outside the probe's callbacks) earns the probe
`overhead_budget` seconds; its callbacks spend them; it keeps at most one
sample's worth, and takes the next sample once it holds the cost of the last
one. So over any stretch of steps the probe's time stays near the budget (the
bucket can bank no more than one sample: a long evaluation between steps buys
one early sample, not a burst), and over the whole run it stays within it once
the first sample is paid back. `every` is the floor: never two samples closer
than `every` steps. Without a budget the probe samples exactly every `every`
steps (deterministic, for tests and for comparing runs sample by sample).

The clock is injected (``time.perf_counter`` by default), so the logic is
tested with a fake clock and no timing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from mixprec.doctor.runtime.thresholds import check_count

__all__ = ["DEFAULT_OVERHEAD_BUDGET", "ProbeCost", "SampleSchedule", "check_budget"]

#: Default share of the run's time the probe may spend in its callbacks. Half of the
#: 10% a probe may cost on any machine: the callbacks are what is timed, and a
#: sample's indirect cost (caches it evicts) comes on top (docs/doctor.md, "Cost").
DEFAULT_OVERHEAD_BUDGET = 0.05


def check_budget(value: object) -> None:
    """Raise unless `value` is None or a number in (0, 1]."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"overhead_budget must be None or a number in (0, 1], got {value!r}")
    if not 0.0 < value <= 1.0:
        raise ValueError(f"overhead_budget must be None or in (0, 1], got {value!r}")


@dataclass(frozen=True, kw_only=True)
class ProbeCost:
    """What the probe has cost so far.

    Attributes:
        steps: steps the probe saw.
        sampled_steps: of those, steps it sampled.
        probe_s: seconds spent in its step callbacks (sampled and other steps).
        run_s: seconds from its first step to its latest, its own time included.
        last_sample_s: seconds its latest sampled step cost (0.0 before any).
    """

    steps: int
    sampled_steps: int
    probe_s: float
    run_s: float
    last_sample_s: float

    @property
    def overhead(self) -> float:
        """Probe time over the run's time without it (0.0 before any run time)."""
        rest = self.run_s - self.probe_s
        return self.probe_s / rest if rest > 0 else 0.0


class SampleSchedule:
    """Decides which steps are sampled and keeps the probe's cost.

    The probe calls `begin` when a step's callbacks start, asks `is_sampled`,
    `charge`s the seconds its callbacks took, and calls `plan_next` at the end of
    each step, which decides the next step. The first step seen is sampled.

    Args:
        every: at least this many steps between two samples.
        overhead_budget: the share of the run's time the probe's callbacks may
            take (in (0, 1]); None: sample exactly every `every` steps.
        clock: seconds, monotonic (``time.perf_counter``).
    """

    def __init__(
        self,
        *,
        every: int,
        overhead_budget: float | None = DEFAULT_OVERHEAD_BUDGET,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        check_count("every", every, 1)
        check_budget(overhead_budget)
        self.every = every
        self.overhead_budget = overhead_budget
        self.clock = clock
        self._start: float | None = None
        self._latest = 0.0
        self._probe_s = 0.0
        self._steps = 0
        self._sampled_steps = 0
        self._last_sampled: int | None = None
        self._last_cost = 0.0
        self._current: int | None = None
        self._current_sampled = False
        self._current_cost = 0.0
        self._decided: tuple[int, bool] | None = None  # (the next step, sampled?)
        self._balance = 0.0  # seconds the probe may still spend (the bucket)
        self._mark: tuple[float, float] | None = None  # (clock, probe_s) at the last update

    def begin(self, step: int) -> float:
        """A step's callbacks start; returns the clock reading (for `charge`)."""
        now = self.clock()
        if self._start is None:
            self._start = now
            self._mark = (now, 0.0)
        self._latest = now
        if step != self._current:
            self._current_sampled = self.is_sampled(step)  # fixed for the whole step
            self._current = step
            self._current_cost = 0.0
            self._steps += 1
            self._sampled_steps += self._current_sampled
        return now

    def is_sampled(self, step: int) -> bool:
        """Whether `step` is sampled (the decision taken when the step before it ended;
        the first step seen is sampled)."""
        if step == self._current:
            return self._current_sampled
        if self._decided is not None and self._decided[0] == step:
            return self._decided[1]
        return self._due(step)  # the first step, or steps that did not follow on

    def charge(self, since: float) -> None:
        """Count the probe's time from `since` (a clock reading) to now."""
        now = self.clock()
        spent = max(now - since, 0.0)
        self._probe_s += spent
        self._current_cost += spent
        self._latest = max(self._latest, now)

    def charge_seconds(self, seconds: float) -> None:
        """Count `seconds` the probe spent outside its step callbacks (hooks that ran
        during the current step's forward and backward) against the current step."""
        spent = max(seconds, 0.0)
        self._probe_s += spent
        self._current_cost += spent

    def plan_next(self, step: int) -> None:
        """`step` is over: decide whether ``step + 1`` is sampled."""
        if self.is_sampled(step):
            self._last_sampled = step
            self._last_cost = self._current_cost
        if self._mark is not None and self.overhead_budget is not None:
            then, probe_then = self._mark
            spent = self._probe_s - probe_then
            earned = self.overhead_budget * max(self._latest - then - spent, 0.0)
            self._balance = min(self._balance + earned - spent, self._last_cost)
            self._mark = (self._latest, self._probe_s)
        self._decided = (step + 1, self._due(step + 1))

    def _due(self, step: int) -> bool:
        last = self._last_sampled
        if last is None:
            return True
        if step - last < self.every:
            return False
        if self.overhead_budget is None:
            return True
        # The bucket holds one more sample like the last.
        return self._balance >= self._last_cost

    @property
    def cost(self) -> ProbeCost:
        """What the probe has cost so far."""
        start = self._start if self._start is not None else self._latest
        return ProbeCost(
            steps=self._steps,
            sampled_steps=self._sampled_steps,
            probe_s=self._probe_s,
            run_s=self._latest - start,
            last_sample_s=self._last_cost,
        )
