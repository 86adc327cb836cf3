"""The report's plots: PNG images drawn with matplotlib from the run records and the decision.

matplotlib (the ``report`` extra) is imported only when a plot is drawn, with its
Agg backend (no display needed), so importing mixprec never loads it. Every
policy has one colour in every plot of every report (`policy_color`), and
legends sit outside the axes, where they cover no bar or curve.
"""

from __future__ import annotations

import io
import math
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from mixprec.experiment.decision import Decision
from mixprec.experiment.records import RunRecord
from mixprec.experiment.report.fp8_plot import plot_fp8
from mixprec.experiment.report.wording import loss_scale_moved

__all__ = ["PLOT_KEYS", "POLICY_COLORS", "draw", "policy_color"]

#: One colour per preset, the same in every plot and every report (the baseline fp32
#: black). Other names (user policies, later presets) get one from `_SPARE_COLORS`
#: by a stable hash of the name.
POLICY_COLORS: Mapping[str, str] = {
    "fp32": "#222222",
    "amp_bf16": "#1f77b4",
    "amp_fp16": "#ff7f0e",
    "fp16_unscaled": "#d62728",
    "bf16_master": "#2ca02c",
    "bf16_lean": "#9467bd",
    "bf16_lean4": "#6a3d9a",
    "bf16_kahan": "#17becf",
    "bf16_sr": "#bcbd22",
    "bf16_pure": "#8c564b",
    "fp8_tensorwise": "#e377c2",
    "fp8_rowwise": "#7f7f7f",
    "fp8_rowwise_gw_hp": "#393b79",
    "auto": "#98df8a",
}
_SPARE_COLORS = ("#aec7e8", "#ffbb78", "#ff9896", "#c5b0d5", "#c49c94", "#9edae5", "#dbdb8d")


def policy_color(policy: str) -> str:
    """The colour of `policy` in every plot (stable across runs and reports)."""
    if policy in POLICY_COLORS:
        return POLICY_COLORS[policy]
    return _SPARE_COLORS[zlib.crc32(policy.encode()) % len(_SPARE_COLORS)]


_MiB = 2.0**20
_COMPONENT_COLORS = {
    "params": "#4C72B0",
    "fp32_islands": "#8172B3",
    "grads": "#55A868",
    "master": "#C44E52",
    "moments": "#DD8452",
    "activations": "#937860",
}


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ImportError("report plots need matplotlib: pip install 'mixprec[report]'") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _policy_colors(policies: Sequence[str]) -> dict[str, str]:
    return {p: policy_color(p) for p in policies}


def _legend_outside(fig: Any, ax: Any) -> None:
    """The axes' legend, right of the figure (constrained layout makes room)."""
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="outside right upper", fontsize=8, frameon=False)


def _ema(points: Sequence[Sequence[float]], alpha: float = 0.1) -> list[float]:
    """The exponential moving average of ``[step, value]`` points, decaying per step, not
    per point: a curve downsampled to every other step (a run of more than 400 steps)
    is smoothed over as many steps as a full one, so runs of different lengths compare."""
    out, acc, last = [], math.nan, 0.0
    for step, v in points:
        if not math.isfinite(v):
            out.append(math.nan)
            continue
        if math.isfinite(acc):
            weight = 1 - (1 - alpha) ** max(1.0, step - last)
            acc += weight * (v - acc)
        else:
            acc = v
        last = step
        out.append(acc)
    return out


def _by_policy(records: Sequence[RunRecord]) -> dict[str, list[RunRecord]]:
    out: dict[str, list[RunRecord]] = {}
    for r in records:
        out.setdefault(r.policy, []).append(r)
    return out


def _mean_band(
    runs: Sequence[RunRecord], smooth: bool
) -> tuple[list[float], list[float], list[float], list[float]]:
    """Steps, mean, min and max over seeds of the training loss (EMA 0.1 if `smooth`)."""
    with_curve = [r for r in runs if r.loss_curve]
    if smooth:
        curves = [_ema(r.loss_curve) for r in with_curve]
    else:
        curves = [[p[1] for p in r.loss_curve] for r in with_curve]
    if not curves:
        return [], [], [], []
    steps = [p[0] for p in next(r for r in runs if r.loss_curve).loss_curve]
    n = min(len(c) for c in curves)
    lo = [min(c[i] for c in curves) for i in range(n)]
    hi = [max(c[i] for c in curves) for i in range(n)]
    mid = [sum(c[i] for c in curves) / len(curves) for i in range(n)]
    return steps[:n], mid, lo, hi


def _plot_loss(records: Sequence[RunRecord], colors: Mapping[str, Any], plt: Any) -> Any:
    """Left: the whole run on a log step axis, so the first steps (where a policy that
    overflows or diverges parts from the baseline) are as wide as the rest. Right: the
    last four fifths, smoothed and zoomed, where the policies' differences show."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), layout="constrained")
    whole, tail = axes
    for policy, runs in _by_policy(records).items():
        steps, mid, lo, hi = _mean_band(runs, smooth=False)
        if not steps:
            continue
        color = colors[policy]
        xs = [st + 1 for st in steps]
        whole.plot(xs, mid, color=color, label=policy, lw=1.1)
        if len(runs) > 1:
            whole.fill_between(xs, lo, hi, color=color, alpha=0.15, lw=0)
        steps, mid, lo, hi = _mean_band(runs, smooth=True)
        tail.plot(steps, mid, color=color, lw=1.4)
        if len(runs) > 1:
            tail.fill_between(steps, lo, hi, color=color, alpha=0.18, lw=0)
    whole.set_xscale("log")
    whole.set_xlabel("step + 1 (log scale)")
    whole.set_ylabel("training loss")
    whole.set_title("Whole run, every step (band: min-max over seeds)", fontsize=9)
    tail.set_xlabel("step")
    tail.set_ylabel("training loss (EMA 0.1)")
    tail.set_title("After the first fifth, smoothed", fontsize=9)
    finite = [
        p[1] for r in records for p in r.loss_curve[len(r.loss_curve) // 5 :] if math.isfinite(p[1])
    ]
    if finite:
        top = sorted(finite)[int(0.98 * (len(finite) - 1))]
        tail.set_ylim(min(finite) * 0.98, top * 1.05)
        first = min(r.loss_curve[len(r.loss_curve) // 5][0] for r in records if r.loss_curve)
        tail.set_xlim(left=first)
    for ax in axes:
        ax.grid(alpha=0.3)
    _legend_outside(fig, whole)
    return fig


def _plot_heldout(
    records: Sequence[RunRecord],
    decision: Decision,
    colors: Mapping[str, Any],
    gap_limit: float,
    plt: Any,
) -> Any:
    """Left: each candidate's held-out loss gap to the baseline at the same step, per seed.
    Right: held-out loss along training (mean over seeds), so capped runs sit where
    they stopped."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.9), layout="constrained")
    ax = axes[0]
    cands = decision.summaries[1:]
    for i, s in enumerate(cands):
        gap = s.gap
        if math.isfinite(gap.mean):
            ax.bar(i, 100 * gap.mean, color=colors[s.policy], alpha=0.8)
        if math.isfinite(gap.low) and math.isfinite(gap.high):
            ax.errorbar(
                i,
                100 * gap.mean,
                yerr=[[100 * (gap.mean - gap.low)], [100 * (gap.high - gap.mean)]],
                color="black",
                capsize=4,
                lw=1,
                zorder=2,
            )
        finite = [100 * g for g in gap.gaps if math.isfinite(g)]
        ax.scatter([i] * len(finite), finite, color="black", s=12, zorder=3)
    ax.axhline(0, color="black", lw=0.8)
    ax.axhline(100 * gap_limit, color="#c33", lw=1, ls="--")
    # Named on the line itself: a legend box would sit on the bars.
    ax.annotate(
        f"gate +{gap_limit:.2%}",
        xy=(1, 100 * gap_limit),
        xycoords=("axes fraction", "data"),
        xytext=(-2, 2),
        textcoords="offset points",
        ha="right",
        va="bottom",
        fontsize=8,
        color="#c33",
    )
    ax.set_xticks(
        range(len(cands)),
        [
            s.policy + ("" if s.steps == decision.summaries[0].steps else f"\n(at step {s.steps})")
            for s in cands
        ],
        rotation=35,
        ha="right",
        fontsize=8,
    )
    ax.set_ylabel(f"held-out loss vs {decision.baseline} (%)")
    ax.set_title(
        "Paired gap to the baseline at the same step\n(dots: seeds; bars: t-interval)",
        fontsize=9,
    )
    ax.grid(axis="y", alpha=0.3)
    ax = axes[1]
    for policy, runs in _by_policy(records).items():
        curves = [r.eval_curve for r in runs if r.ok and r.eval_curve]
        if not curves:
            continue
        steps = sorted({int(p[0]) for c in curves for p in c})
        mean = []
        for st in steps:
            vals = [float(p[1]) for c in curves for p in c if int(p[0]) == st]
            mean.append(sum(vals) / len(vals))
        ax.plot(steps, mean, marker="o", ms=3, color=colors[policy], label=policy, lw=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("held-out loss")
    ax.set_title("Held-out loss during training (mean over seeds)", fontsize=9)
    ax.grid(alpha=0.3)
    _legend_outside(fig, ax)
    return fig


def _plot_scale(records: Sequence[RunRecord], colors: Mapping[str, Any], plt: Any) -> Any | None:
    """The loss scale of each run of the policies whose scale moved in some run (a scale
    that never moved is a sentence under "What the data show", not a flat line)."""
    moved = {policy for policy, did in loss_scale_moved(records).items() if did}
    scaled = [r for r in records if r.policy in moved and r.loss_scale_trace]
    if not scaled:
        return None
    fig, ax = plt.subplots(figsize=(9, 3.2), layout="constrained")
    for r in scaled:
        xs = [p[0] for p in r.loss_scale_trace] + [r.steps]
        ys = [p[1] for p in r.loss_scale_trace]
        ys.append(ys[-1])
        ax.step(
            xs, ys, where="post", color=colors[r.policy], label=f"{r.policy} seed {r.seed}", lw=1.2
        )
    ax.set_yscale("log", base=2)
    ax.set_xlabel("step")
    ax.set_ylabel("loss scale")
    ax.set_title(
        "Loss scale (drops: overflow, step skipped; rises: growth after clean steps)", fontsize=9
    )
    ax.grid(alpha=0.3)
    _legend_outside(fig, ax)
    return fig


def _color_ticks(ax: Any, names: Sequence[str], colors: Mapping[str, Any]) -> None:
    for label, name in zip(ax.get_xticklabels(), names, strict=True):
        label.set_color(colors[name])


def _plot_memory(
    records: Sequence[RunRecord], decision: Decision, colors: Mapping[str, Any], plt: Any
) -> Any:
    """Measured bytes by component: everything (left) and the training state alone (right).
    The bars are coloured by component; the policy names keep their colours."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.9), layout="constrained")
    names = [s.policy for s in decision.summaries]
    first = {r.policy: r for r in records if r.bytes}
    xs = range(len(names))
    for ax, with_acts in ((axes[0], True), (axes[1], False)):
        bottoms = [0.0] * len(names)
        for comp, color in _COMPONENT_COLORS.items():
            if comp == "activations" and not with_acts:
                continue
            vals = [first[n].bytes.get(comp, 0) / _MiB if n in first else 0.0 for n in names]
            if not any(vals):
                continue
            ax.bar(xs, vals, bottom=bottoms, color=color, label=comp)
            bottoms = [b + v for b, v in zip(bottoms, vals, strict=True)]
        predicted = []
        for n in names:
            p = first[n].predicted_bytes if n in first else {}
            total = float(p.get("total", math.nan))
            predicted.append(
                (total if with_acts else total - float(p.get("activations", 0))) / _MiB
            )
        ax.scatter(xs, predicted, marker="_", s=400, color="black", label="predicted", zorder=3)
        ax.set_xticks(xs, names, rotation=35, ha="right", fontsize=8)
        _color_ticks(ax, names, colors)
        ax.set_ylabel("MiB")
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_title("Measured memory of one step, by component", fontsize=9)
    axes[1].set_title("Training state only (params, grads, master, moments)", fontsize=9)
    _legend_outside(fig, axes[0])
    return fig


def _plot_step_time(decision: Decision, colors: Mapping[str, Any], plt: Any) -> Any:
    """Each candidate's step time over the baseline's on the same seed: a dot per seed,
    a bar at the mean (the table's figure), the baseline at 1. Absolute steps/s are not
    drawn: runs of different seeds ran under different loads, and only the paired ratio
    cancels that."""
    fig, ax = plt.subplots(figsize=(9, 3.6), layout="constrained")
    cands = decision.summaries[1:]
    for i, s in enumerate(cands):
        values = [v for v in s.time_ratio.values if math.isfinite(v)]
        if not values:
            continue
        color = colors[s.policy]
        ax.scatter([i] * len(values), values, color=color, s=16, alpha=0.7, zorder=3)
        mean = s.time_ratio.mean
        if math.isfinite(mean):
            ax.plot([i], [mean], marker="_", ms=26, mew=2.5, color=color, ls="none", zorder=4)
            ax.annotate(
                f"{mean:.2f}x",
                xy=(i, mean),
                xytext=(14, 0),
                textcoords="offset points",
                va="center",
                fontsize=7,
            )
    ax.axhline(1, color=colors.get(decision.baseline, "black"), lw=1, ls="--")
    ax.set_xticks(
        range(len(cands)),
        [s.policy + (" (emulated)" if s.policy in decision.emulated else "") for s in cands],
        rotation=35,
        ha="right",
        fontsize=8,
    )
    _color_ticks(ax, [s.policy for s in cands], colors)
    ax.set_ylabel(f"step time / {decision.baseline}'s (same seed)")
    ax.set_xlim(-0.6, max(len(cands), 1) - 0.4)
    ax.margins(y=0.15)
    ax.set_title(
        f"Step time relative to {decision.baseline} (dashed, 1) on the same seed: dots per seed, "
        "bar at the mean",
        fontsize=9,
    )
    ax.grid(axis="y", alpha=0.3)
    return fig


def _plot_cost_quality(
    decision: Decision, colors: Mapping[str, Any], gap_limit: float, plt: Any
) -> Any | None:
    """What the decision weighs: each candidate's paired loss gap (its mean, whiskers its
    t-interval) against its memory (left) and step time (right) relative to the
    baseline (whiskers: the range over seeds); the baseline at (0, 1), the gap limit
    dashed. A candidate left of the line whose interval ends left of it is eligible."""
    cands = [s for s in decision.summaries[1:] if math.isfinite(s.gap.mean)]
    if not cands:
        return None
    base = decision.baseline
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), layout="constrained")
    for ax, ratio, what in (
        (axes[0], "memory_ratio", "memory"),
        (axes[1], "time_ratio", "step time"),
    ):
        ax.scatter([0.0], [1.0], marker="s", s=40, color=colors.get(base, "black"), label=base)
        for s in cands:
            r = getattr(s, ratio)
            if not math.isfinite(r.mean):
                continue
            x, gap = 100 * s.gap.mean, s.gap
            color = colors[s.policy]
            ax.scatter([x], [r.mean], s=36, color=color, label=s.policy, zorder=3)
            if math.isfinite(gap.low) and math.isfinite(gap.high):
                ax.errorbar(
                    x,
                    r.mean,
                    # max(0, ...): a mean of equal values can sit an ulp outside them.
                    xerr=[[max(0.0, x - 100 * gap.low)], [max(0.0, 100 * gap.high - x)]],
                    yerr=[[max(0.0, r.mean - r.low)], [max(0.0, r.high - r.mean)]],
                    fmt="none",
                    ecolor=color,
                    capsize=3,
                    lw=1,
                )
        ax.axvline(100 * gap_limit, color="#c33", lw=1, ls="--")
        ax.annotate(
            f"gap limit +{gap_limit:.2%}",
            xy=(100 * gap_limit, 1),
            xycoords=("data", "axes fraction"),
            xytext=(3, -3),
            textcoords="offset points",
            va="top",
            fontsize=8,
            color="#c33",
        )
        ax.axhline(1, color="black", lw=0.6, alpha=0.5)
        ax.axvline(0, color="black", lw=0.6, alpha=0.5)
        # Frame the means and the limit: a wide interval (2 seeds: t = 6.31) would
        # otherwise squeeze every other policy onto one vertical line; its whiskers run
        # off the axes, which says the same.
        core = [0.0, 100 * gap_limit, *(100 * s.gap.mean for s in cands)]
        margin = max(max(core) - min(core), 100 * gap_limit, 0.1)
        ax.set_xlim(min(core) - margin, max(core) + margin)
        ax.set_xlabel(f"held-out loss gap to {base} (%, paired per seed; whiskers: t-interval)")
        ax.set_ylabel(f"{what} / {base}'s on the same seed (whiskers: range)")
        ax.set_title(f"{what.capitalize()} against quality (lower left is better)", fontsize=9)
        ax.grid(alpha=0.3)
    _legend_outside(fig, axes[0])
    return fig


def _png(fig: Any, plt: Any) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


#: Every plot a report can hold, by key, in report order.
PLOT_KEYS = ("cost_quality", "loss", "heldout", "loss_scale", "fp8", "memory", "step_time")


def draw(
    keys: Sequence[str],
    records: Sequence[RunRecord],
    decision: Decision,
    *,
    gap_limit: float,
) -> dict[str, bytes]:
    """Draw the plots named by `keys` (see `PLOT_KEYS`) as PNG bytes, by key.

    Args:
        keys: the plots to draw.
        records: the run records (curves, loss-scale traces, measured bytes).
        decision: the decision (policy order, paired gaps, memory and step-time ratios).
        gap_limit: the loss-gap gate, drawn as a line on the gap and cost plots.

    Raises:
        ImportError: matplotlib is not installed (``pip install 'mixprec[report]'``).
        ValueError: an unknown key, ``cost_quality`` without a paired gap,
            ``loss_scale`` without a loss scale that moved, or ``fp8`` without an FP8
            trace.
    """
    plt = _pyplot()
    colors = _policy_colors([*(s.policy for s in decision.summaries), *(r.policy for r in records)])
    makers: dict[str, Callable[[], Any]] = {
        "cost_quality": lambda: _plot_cost_quality(decision, colors, gap_limit, plt),
        "loss": lambda: _plot_loss(records, colors, plt),
        "heldout": lambda: _plot_heldout(records, decision, colors, gap_limit, plt),
        "loss_scale": lambda: _plot_scale(records, colors, plt),
        "fp8": lambda: plot_fp8(records, decision, colors, plt),
        "memory": lambda: _plot_memory(records, decision, colors, plt),
        "step_time": lambda: _plot_step_time(decision, colors, plt),
    }
    out: dict[str, bytes] = {}
    for key in keys:
        if key not in makers:
            raise ValueError(f"unknown plot {key!r}; valid plots: {list(PLOT_KEYS)}")
        fig = makers[key]()
        if fig is None:
            what = {
                "fp8": "no run stored an FP8 trace",
                "loss_scale": "no run's loss scale moved",
                "cost_quality": "no candidate has a paired gap",
            }[key]
            raise ValueError(f"plot {key!r} has nothing to draw ({what})")
        out[key] = _png(fig, plt)
    return out
