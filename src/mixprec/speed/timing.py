"""Timing steps of several formats fairly: warm-up, interleaved repeats, an injectable timer.

Every format first runs `warmup` untimed steps (one-time costs: kernel selection,
allocator growth, autocast's weight casts). Then `repeats` rounds each run every
format once, in an order rotated every round, so that a burst of load from
another process, or a cache warmed by the previous format, falls on all of them
alike. The decision reads two estimates of each format's step time: its fastest
sample (load from other processes only ever adds time) and its median (one
lucky quiet moment does not move it).

The timer is a parameter: `wall_clock_timer` on real runs, a fake returning fixed
numbers in tests (which still runs the step, so the step itself is exercised).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping

import torch

__all__ = [
    "Step",
    "StepTimer",
    "best_times",
    "median_times",
    "time_interleaved",
    "wall_clock_timer",
]

#: One training step of one format (forward and backward), run for its effect on time.
Step = Callable[[], None]

#: ``timer(format_name, step) -> seconds``: runs `step` once and returns how long it took.
StepTimer = Callable[[str, Step], float]


def wall_clock_timer(
    device: torch.device | str = "cpu", *, clock: Callable[[], float] = time.perf_counter
) -> StepTimer:
    """A `StepTimer` reading `clock` (seconds) around one step, with the device's
    queued work finished before and after (CUDA, MPS and XPU run asynchronously)."""
    kind = torch.device(device).type
    sync: Callable[[], None]
    if kind == "cuda":
        sync = torch.cuda.synchronize
    elif kind == "mps":
        sync = torch.mps.synchronize
    elif kind == "xpu":
        sync = torch.xpu.synchronize
    else:

        def sync() -> None:
            return None

    def timer(name: str, step: Step) -> float:
        del name  # every format is timed alike
        sync()
        start = clock()
        step()
        sync()
        return clock() - start

    return timer


def time_interleaved(
    steps: Mapping[str, Step],
    *,
    timer: StepTimer,
    warmup: int,
    repeats: int,
    should_stop: Callable[[], bool] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, tuple[float, ...]]:
    """Each format's step times (seconds), `repeats` samples each, taken interleaved.

    Args:
        steps: the step of each format, in a fixed order (the first round's).
        timer: runs one step and returns its duration in seconds.
        warmup: untimed steps of each format first (all formats, round by round).
        repeats: timed rounds; round ``r`` starts at the ``r``-th format (rotation).
        should_stop: polled before each step (e.g. a Ctrl-C flag); when it returns
            True the timing stops by raising `KeyboardInterrupt`.
        progress: called after each step with (steps done, steps in all).

    Raises:
        ValueError: no steps, ``warmup < 0``, ``repeats < 1``, or a timer that
            returns a time that is not positive and finite.
        KeyboardInterrupt: `should_stop` returned True.
    """
    if not steps:
        raise ValueError("no formats to time")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup!r}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats!r}")
    names = list(steps)
    total = (warmup + repeats) * len(names)
    done = 0

    def run(name: str) -> float:
        nonlocal done
        if should_stop is not None and should_stop():
            raise KeyboardInterrupt
        seconds = float(timer(name, steps[name]))
        done += 1
        if progress is not None:
            progress(done, total)
        return seconds

    for _ in range(warmup):
        for name in names:
            run(name)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(repeats):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            seconds = run(name)
            if not (seconds > 0 and seconds != float("inf")):
                raise ValueError(f"timer returned {seconds!r} s for a {name} step")
            samples[name].append(seconds)
    return {name: tuple(values) for name, values in samples.items()}


def median_times(samples: Mapping[str, tuple[float, ...]]) -> dict[str, float]:
    """The median of each format's samples."""
    return {name: statistics.median(values) for name, values in samples.items()}


def best_times(samples: Mapping[str, tuple[float, ...]]) -> dict[str, float]:
    """The fastest of each format's samples."""
    return {name: min(values) for name, values in samples.items()}
