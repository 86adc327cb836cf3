"""Interleaved timing: warm-up first, rotated rounds, checked timer values; no real clock."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest

from mixprec.speed import time_interleaved, wall_clock_timer
from mixprec.speed.timing import best_times, median_times

from .conftest import FakeTimer


def _steps(log: list[str]) -> dict[str, Callable[[], None]]:
    return {name: (lambda name=name: log.append(name)) for name in ("fp32", "bf16", "fp16")}


def test_warmup_then_rotated_rounds(fake_timer: Callable[..., FakeTimer]) -> None:
    ran: list[str] = []
    timer = fake_timer({"fp32": [9.0, 1.0, 1.1, 1.2], "bf16": [9.0, 2.0, 2.1, 2.2], "fp16": 3.0})
    samples = time_interleaved(_steps(ran), timer=timer, warmup=1, repeats=3)
    assert timer.calls == [
        *("fp32", "bf16", "fp16"),  # warm-up, untimed
        *("fp32", "bf16", "fp16"),
        *("bf16", "fp16", "fp32"),
        *("fp16", "fp32", "bf16"),
    ]
    assert ran == timer.calls, "every timed call ran its step"
    assert samples == {"fp32": (1.0, 1.1, 1.2), "bf16": (2.0, 2.1, 2.2), "fp16": (3.0,) * 3}
    assert best_times(samples)["fp32"] == 1.0 and median_times(samples)["bf16"] == 2.1


def test_no_warmup(fake_timer: Callable[..., FakeTimer]) -> None:
    timer = fake_timer({"fp32": 1.0, "bf16": 2.0, "fp16": 3.0})
    time_interleaved(_steps([]), timer=timer, warmup=0, repeats=1)
    assert timer.calls == ["fp32", "bf16", "fp16"]


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
def test_a_timer_returning_nonsense_is_refused(
    bad: float, fake_timer: Callable[..., FakeTimer]
) -> None:
    timer = fake_timer({"fp32": bad, "bf16": 1.0, "fp16": 1.0})
    with pytest.raises(ValueError, match="timer returned"):
        time_interleaved(_steps([]), timer=timer, warmup=0, repeats=1)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"warmup": -1, "repeats": 1}, "warmup"), ({"warmup": 0, "repeats": 0}, "repeats")],
)
def test_bad_counts(
    kwargs: dict[str, int], match: str, fake_timer: Callable[..., FakeTimer]
) -> None:
    with pytest.raises(ValueError, match=match):
        time_interleaved(_steps([]), timer=fake_timer({}), **kwargs)
    with pytest.raises(ValueError, match="no formats"):
        time_interleaved({}, timer=fake_timer({}), warmup=0, repeats=1)


def test_wall_clock_timer_reads_its_clock_around_one_step() -> None:
    ticks = iter([10.0, 12.5])
    ran: list[str] = []
    timer = wall_clock_timer("cpu", clock=lambda: next(ticks))
    assert timer("bf16", lambda: ran.append("step")) == 2.5
    assert ran == ["step"]


def test_progress_counts_every_step_and_a_stop_request_interrupts(
    fake_timer: Callable[..., FakeTimer],
) -> None:
    seen: list[tuple[int, int]] = []
    timer = fake_timer({"fp32": 1.0, "bf16": 2.0, "fp16": 3.0})
    time_interleaved(
        _steps([]), timer=timer, warmup=1, repeats=2, progress=lambda d, t: seen.append((d, t))
    )
    assert seen == [(d, 9) for d in range(1, 10)]
    timer = fake_timer({"fp32": 1.0, "bf16": 2.0, "fp16": 3.0})
    with pytest.raises(KeyboardInterrupt):
        time_interleaved(
            _steps([]), timer=timer, warmup=1, repeats=2, should_stop=lambda: len(timer.calls) >= 4
        )
    assert len(timer.calls) == 4, "stopped before the fifth step"
