"""The report's FP8 panel: amax and scale of the worst fp8 tensors over training, and the
share of values the casts saturate and underflow, per FP8 policy.

Drawn from the records' FP8 traces (`mixprec.experiment.fp8_trace`) by
`mixprec.experiment.report.plots.draw` (key ``fp8``). Each policy keeps its colour
(`plots.policy_color`); line styles tell its worst tensors apart (top row) and
measured from the delayed-scaling what-if (bottom row, dashed with ``x`` markers, so a
single what-if point shows). Legends sit outside the axes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from mixprec.experiment.decision import Decision
from mixprec.experiment.fp8_trace import Fp8TensorTrace
from mixprec.experiment.records import RunRecord
from mixprec.experiment.report.fp8 import fp8_records, worst_tensors

__all__ = ["TENSORS_PER_POLICY", "has_fp8_trace", "plot_fp8"]

#: Worst tensors drawn per FP8 policy in the amax and scale plots.
TENSORS_PER_POLICY = 3

_STYLES = ("-", "--", ":", "-.")


def has_fp8_trace(records: Sequence[RunRecord]) -> bool:
    """Some finished run stored an FP8 trace (the panel has something to draw)."""
    return any(r.ok and r.fp8_trace is not None and r.fp8_trace.tensors for r in records)


def _first_trace(runs: Sequence[RunRecord], label: str) -> Fp8TensorTrace | None:
    """`label`'s trace in the lowest seed that holds it in full."""
    for r in runs:
        if r.fp8_trace is None:
            continue
        for t in r.fp8_trace.worst:
            if t.label == label:
                return t
    return None


def _worst_per_step(runs: Sequence[RunRecord], series: str) -> tuple[list[int], list[float]]:
    """Per sampled step, the largest value of `series` over every tensor (aggregates
    included) and every seed; NaN steps (no what-if yet) are left out."""
    worst: dict[int, float] = {}
    for r in runs:
        if r.fp8_trace is None:
            continue
        for t in r.fp8_trace.tensors:
            for step, v in zip(t.steps, getattr(t, series), strict=True):
                if math.isfinite(v):
                    worst[step] = max(v, worst.get(step, -math.inf))
    steps = sorted(worst)
    return steps, [worst[s] for s in steps]


def plot_fp8(
    records: Sequence[RunRecord], decision: Decision, colors: Mapping[str, Any], plt: Any
) -> Any | None:
    """The FP8 panel (None when no run stored an FP8 trace)."""
    runs = {
        name: mine for name, mine in fp8_records(records, decision).items() if has_fp8_trace(mine)
    }
    if not runs:
        return None
    fig, axes = plt.subplots(2, 2, figsize=(12, 7.2), layout="constrained")
    (amax_ax, scale_ax), (sat_ax, under_ax) = axes
    tensor_handles = []
    for name, mine in runs.items():
        color = colors[name]
        for i, peaks in enumerate(worst_tensors(mine, TENSORS_PER_POLICY)):
            t = _first_trace(mine, peaks.label)
            if t is None:
                continue
            style = _STYLES[i % len(_STYLES)]
            (line,) = amax_ax.plot(
                t.steps, t.amax, color=color, ls=style, lw=1.2, label=f"{name}: {t.label}"
            )
            scale_ax.plot(t.steps, t.scale, color=color, ls=style, lw=1.2)
            tensor_handles.append(line)
        for ax, series in ((sat_ax, "saturated"), (under_ax, "underflow")):
            steps, values = _worst_per_step(mine, series)
            ax.plot(steps, [100 * v for v in values], color=color, lw=1.4, marker="o", ms=2.5)
        # Markers: the what-if is null at a tensor's first sample (no amax history yet),
        # so a short run may have a single point, which a bare line does not draw.
        steps, values = _worst_per_step(mine, "delayed_saturated")
        sat_ax.plot(
            steps, [100 * v for v in values], color=color, lw=1.0, ls="--", marker="x", ms=3.5
        )
    for ax in (amax_ax, scale_ax):
        ax.set_yscale("log")
    amax_ax.set_ylabel("amax")
    amax_ax.set_title(
        f"amax of each policy's {TENSORS_PER_POLICY} worst fp8 tensors (lowest seed)", fontsize=9
    )
    scale_ax.set_ylabel("scale (smallest of the casts)")
    scale_ax.set_title("Scale their casts used (fp8 max / amax; rowwise: a power of 2)", fontsize=9)
    sat_ax.set_ylabel("saturated (% of elements)")
    sat_ax.set_title(
        "Clipped at the format's max, worst tensor per step over seeds\n"
        "(solid: measured; dashed: delayed-scaling what-if)",
        fontsize=9,
    )
    under_ax.set_ylabel("underflow (% of non-zero elements)")
    under_ax.set_title("Flushed to zero, worst tensor per step over seeds (measured)", fontsize=9)
    for ax in axes.flat:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in (sat_ax, under_ax):
        ax.set_ylim(bottom=0)
        if ax.get_ylim()[1] <= 0:
            ax.set_ylim(0, 1)
    policy_handles = [
        plt.Line2D([], [], color=colors[name], lw=1.4, marker="o", ms=2.5, label=name)
        for name in runs
    ]
    style_handles = [
        plt.Line2D([], [], color="#555555", lw=1.4, label="measured"),
        plt.Line2D(
            [], [], color="#555555", lw=1.0, ls="--", marker="x", ms=3.5, label="delayed what-if"
        ),
    ]
    fig.legend(
        handles=tensor_handles,
        loc="outside right upper",
        fontsize=7,
        frameon=False,
        title="worst tensors",
        title_fontsize=8,
    )
    fig.legend(
        handles=policy_handles + style_handles,
        loc="outside right lower",
        fontsize=7,
        frameon=False,
        title="policies",
        title_fontsize=8,
    )
    return fig
