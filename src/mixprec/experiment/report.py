"""Reports of a precision experiment: results.json, report.md, report.html, a terminal table.

Everything is rendered from the run records and the contract, so `mixprec report
DIR` re-renders a report without training. Plots use matplotlib's Agg backend
(no display needed); report.html embeds them, report.md links the PNG files.
"""

from __future__ import annotations

import base64
import datetime as _dt
import html
import io
import math
import platform
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mixprec.experiment.contract import Contract
from mixprec.experiment.decision import Decision, PolicySummary, format_interval, tail_start
from mixprec.experiment.records import RunRecord, write_json_atomic

__all__ = [
    "Report",
    "headline",
    "render",
    "results_dict",
    "terminal_table",
    "verdict_label",
    "verdict_reason",
]

_MiB = 2.0**20
_COMPONENT_COLORS = {
    "params": "#4C72B0",
    "fp32_islands": "#8172B3",
    "grads": "#55A868",
    "master": "#C44E52",
    "moments": "#DD8452",
    "activations": "#937860",
}


@dataclass(frozen=True, kw_only=True)
class Report:
    """Paths of a rendered report."""

    results_json: Path
    markdown: Path
    html: Path
    plots: tuple[Path, ...]


def results_dict(
    contract: Contract,
    records: Sequence[RunRecord],
    decision: Decision,
    *,
    workload_description: str = "",
    metric_name: str = "",
    higher_is_better: bool = True,
) -> dict[str, Any]:
    """The results.json document (contract: workload, baseline, runs, decision)."""
    return {
        "workload": contract.workload,
        "workload_description": workload_description,
        "metric_name": metric_name,
        "higher_is_better": higher_is_better,
        "baseline": contract.baseline,
        "contract": contract.to_dict(),
        "runs": [
            {**r.to_dict(), "doctor": r.doctor_rules, "doctor_findings": list(r.doctor)}
            for r in records
        ],
        "decision": decision.to_dict(),
        "environment": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        },
    }


# ------------------------------------------------------------------ tables


def _fmt(v: float, spec: str) -> str:
    return "-" if v is None or not math.isfinite(v) else format(v, spec)


_STATUS_WORDS = {
    "eligible": "eligible",
    "rejected": "rejected",
    "inconclusive": "inconclusive",
    "too_short": "too short to judge",
}


def verdict_label(name: str, decision: Decision) -> str:
    """A short verdict: ``RECOMMENDED``, ``eligible``, ``rejected (gate)``, ``inconclusive``..."""
    if name == decision.baseline:
        if not decision.baseline_ok:
            return "baseline FAILED"
        return "baseline (too short to judge)" if decision.too_short else "baseline"
    if name == decision.recommended:
        return "RECOMMENDED"
    v = decision.verdicts.get(name)
    if v is None:
        return "?"
    word = _STATUS_WORDS[v.status]
    return f"{word} ({v.gate})" if v.status == "rejected" else word


def verdict_reason(name: str, decision: Decision) -> str:
    """The sentence behind the verdict, with acknowledged doctor rules."""
    if name == decision.baseline:
        if not decision.baseline_ok:
            return decision.baseline_reason
        return decision.too_short
    v = decision.verdicts.get(name)
    if v is None:
        return ""
    note = decision.notes.get(name, "")
    return v.reason + (f"; {note}" if note else "")


def _verdict(name: str, decision: Decision) -> str:
    reason = verdict_reason(name, decision)
    return verdict_label(name, decision) + (f": {reason}" if reason else "")


_SEVERITY_RANK = {"error": 0, "warning": 1, "info": 2}


def _doctor_cell(policy: str, records: Sequence[RunRecord]) -> str:
    """Rule ids with their worst severity, most severe first."""
    worst: dict[str, str] = {}
    for r in records:
        if r.policy != policy:
            continue
        for f in r.doctor:
            rule, sev = str(f.get("rule", "")), str(f.get("severity", "info"))
            if rule and _SEVERITY_RANK.get(sev, 3) < _SEVERITY_RANK.get(worst.get(rule, ""), 3):
                worst[rule] = sev
    ordered = sorted(worst.items(), key=lambda kv: (_SEVERITY_RANK.get(kv[1], 3), kv[0]))
    return ", ".join(f"{rule} ({sev})" for rule, sev in ordered) or "-"


def _gap_cell(s: PolicySummary, decision: Decision) -> str:
    if s.policy == decision.baseline:
        spread = s.baseline_spread
        return f"seed spread {spread:.2%} (sd)" if math.isfinite(spread) else "-"
    return format_interval(s.gap)


def _rows(decision: Decision, records: Sequence[RunRecord]) -> list[list[str]]:
    full = max((s.steps for s in decision.summaries), default=0)
    rows = []
    for s in decision.summaries:
        rows.append(
            [
                s.policy,
                str(s.steps) if s.steps == full else f"{s.steps} of {full}",
                str(len(s.heldout_losses)),
                _fmt(s.heldout_loss, ".4f"),
                _gap_cell(s, decision),
                _fmt(s.metric, ".4f"),
                f"{s.skipped_fraction:.1%}",
                _fmt(s.total_bytes / _MiB, ".2f"),
                _fmt(s.steps_per_s, ".1f"),
                _fmt(s.frozen_fraction * 100, ".1f") + "%",
                _doctor_cell(s.policy, records),
                _verdict(s.policy, decision),
            ]
        )
    return rows


_HEADERS = [
    "policy",
    "steps",
    "seeds",
    "held-out loss",
    "gap to baseline [interval]",
    "metric",
    "skipped",
    "memory MiB",
    "steps/s",
    "frozen",
    "doctor",
    "verdict",
]


def terminal_table(
    decision: Decision, metric_name: str = "metric", records: Sequence[RunRecord] = ()
) -> str:
    """A plain-text decision table (without the doctor column), then every reason."""
    headers = [h if h != "metric" else metric_name for h in _HEADERS]
    doctor = _HEADERS.index("doctor")
    rows = [
        [*r[:doctor], verdict_label(s.policy, decision)]
        for r, s in zip(_rows(decision, records), decision.summaries, strict=True)
    ]
    headers = headers[:doctor] + headers[doctor + 1 :]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    for r in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    reasons = [
        f"  {s.policy}: {verdict_label(s.policy, decision)}: {verdict_reason(s.policy, decision)}"
        for s in decision.summaries
        if verdict_reason(s.policy, decision)
    ]
    if reasons:
        lines += ["", "why:", *reasons]
    return "\n".join(lines)


def _md_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    def esc(c: str) -> str:
        return c.replace("|", "\\|")

    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(esc(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


# ------------------------------------------------------------------- plots


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ImportError("report plots need matplotlib: pip install 'mixprec[report]'") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _policy_colors(policies: Sequence[str]) -> dict[str, Any]:
    plt = _pyplot()
    cmap = plt.get_cmap("tab10")
    return {p: cmap(i % 10) for i, p in enumerate(policies)}


def _ema(values: Sequence[float], alpha: float = 0.1) -> list[float]:
    out, acc = [], math.nan
    for v in values:
        if not math.isfinite(v):
            out.append(math.nan)
            continue
        acc = v if not math.isfinite(acc) else alpha * v + (1 - alpha) * acc
        out.append(acc)
    return out


def _by_policy(records: Sequence[RunRecord]) -> dict[str, list[RunRecord]]:
    out: dict[str, list[RunRecord]] = {}
    for r in records:
        out.setdefault(r.policy, []).append(r)
    return out


def _plot_loss(records: Sequence[RunRecord], colors: Mapping[str, Any], plt: Any) -> Any:
    fig, ax = plt.subplots(figsize=(8, 4.2))
    for policy, runs in _by_policy(records).items():
        curves = [_ema([p[1] for p in r.loss_curve]) for r in runs if r.loss_curve]
        if not curves:
            continue
        steps = [p[0] for p in runs[0].loss_curve]
        n = min(len(c) for c in curves)
        lo = [min(c[i] for c in curves) for i in range(n)]
        hi = [max(c[i] for c in curves) for i in range(n)]
        mid = [sum(c[i] for c in curves) / len(curves) for i in range(n)]
        ax.plot(steps[:n], mid, color=colors[policy], label=policy, lw=1.4)
        if len(curves) > 1:
            ax.fill_between(steps[:n], lo, hi, color=colors[policy], alpha=0.18, lw=0)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (EMA 0.1)")
    ax.set_title("Training loss per policy (band: min-max over seeds)")
    finite = [
        p[1] for r in records for p in r.loss_curve[len(r.loss_curve) // 5 :] if math.isfinite(p[1])
    ]
    if finite:
        top = sorted(finite)[int(0.98 * (len(finite) - 1))]
        ax.set_ylim(min(finite) * 0.98, top * 1.05)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
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
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
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
    ax.axhline(100 * gap_limit, color="#c33", lw=1, ls="--", label=f"gate: +{gap_limit:.2%}")
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
    ax.legend(fontsize=8)
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
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return fig


def _plot_scale(records: Sequence[RunRecord], colors: Mapping[str, Any], plt: Any) -> Any | None:
    scaled = [r for r in records if r.loss_scale_trace]
    if not scaled:
        return None
    fig, ax = plt.subplots(figsize=(8, 3.2))
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
    ax.set_title("Loss scale (drops: overflow, step skipped; rises: growth after clean steps)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def _plot_memory(records: Sequence[RunRecord], decision: Decision, plt: Any) -> Any:
    """Measured bytes by component: everything (left) and the training state alone (right)."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.9))
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
        ax.set_ylabel("MiB")
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_title("Measured memory of one step, by component", fontsize=9)
    axes[1].set_title("Training state only (params, grads, master, moments)", fontsize=9)
    axes[0].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return fig


def _plot_throughput(decision: Decision, colors: Mapping[str, Any], plt: Any) -> Any:
    fig, ax = plt.subplots(figsize=(8, 3.2))
    names = [s.policy for s in decision.summaries]
    vals = [s.steps_per_s for s in decision.summaries]
    ax.bar(range(len(names)), vals, color=[colors[n] for n in names])
    for i, v in enumerate(vals):
        if math.isfinite(v):
            ax.text(i, v, f"{v:.1f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(names)), names, rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("steps / s")
    ax.set_title("Training throughput on this machine")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


def _save(fig: Any, path: Path, plt: Any) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    data = buf.getvalue()
    path.write_bytes(data)
    return data


# ------------------------------------------------------------------- render


def _findings(
    records: Sequence[RunRecord], order: Sequence[str] = ()
) -> dict[str, list[Mapping[str, Any]]]:
    out: dict[str, list[Mapping[str, Any]]] = {name: [] for name in order}
    for r in records:
        seen = {(f.get("rule"), f.get("where")) for f in out.get(r.policy, [])}
        for f in r.doctor:
            key = (f.get("rule"), f.get("where"))
            if key not in seen:
                out.setdefault(r.policy, []).append(f)
                seen.add(key)
    return out


def _observations(records: Sequence[RunRecord], decision: Decision) -> list[str]:
    """Plain statements read off the data; nothing here is asserted without it."""
    notes: list[str] = []
    base = decision.summaries[0] if decision.summaries else None
    if base is not None and math.isfinite(base.baseline_spread):
        notes.append(
            f"`{base.policy}` alone varies by {base.baseline_spread:.2%} (relative sd of "
            f"held-out loss over {len(base.heldout_losses)} seeds); gaps are judged per seed, "
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
    for r in records:
        if r.frozen_fraction.get("norm", 0) > 0.5 and r.seed == 0:
            notes.append(
                f"`{r.policy}`: {r.frozen_fraction['norm']:.1%} of norm-layer parameters "
                "never left their initial value"
            )
    return notes


def headline(decision: Decision) -> str:
    """One sentence: the recommendation, or why there is none."""
    if not decision.baseline_ok:
        return f"The baseline failed its own gates: {decision.baseline_reason}"
    if decision.too_short:
        return f"No recommendation, too short to judge: {decision.too_short}."
    if decision.recommended:
        return (
            f"Recommended: **{decision.recommended}** (the eligible candidate with the least "
            "measured memory; the table says why each other candidate was not)"
        )
    if decision.inconclusive:
        return (
            "No recommendation: no candidate is settled within the gap limit "
            f"(inconclusive: {', '.join(decision.inconclusive)}, "
            f"after up to {decision.max_seeds} seeds)."
        )
    return "No candidate passed the gates."


def render(
    out_dir: Path,
    contract: Contract,
    records: Sequence[RunRecord],
    decision: Decision,
    *,
    workload_description: str = "",
    metric_name: str = "metric",
    higher_is_better: bool = True,
    settings: Mapping[str, Any] | None = None,
    notes: Sequence[str] = (),
) -> Report:
    """Write results.json, report.md, report.html and the plots into `out_dir`.

    `notes` (records skipped or missing, say) are listed first under "What the data
    show" and stored in results.json.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    plots_dir = out_dir / "plots"
    plots_dir.mkdir(exist_ok=True)
    results = results_dict(
        contract,
        records,
        decision,
        workload_description=workload_description,
        metric_name=metric_name,
        higher_is_better=higher_is_better,
    )
    if settings is not None:
        results["settings"] = dict(settings)
    results["notes"] = list(notes)
    results_path = out_dir / "results.json"
    write_json_atomic(results_path, results)

    plt = _pyplot()
    colors = _policy_colors([s.policy for s in decision.summaries])
    figures: list[tuple[str, str, Any]] = [
        ("loss", "Training loss", _plot_loss(records, colors, plt)),
        (
            "heldout",
            "Held-out loss",
            _plot_heldout(records, decision, colors, contract.gates.max_rel_loss_gap, plt),
        ),
    ]
    scale_fig = _plot_scale(records, colors, plt)
    if scale_fig is not None:
        figures.append(("loss_scale", "Loss scale", scale_fig))
    figures.append(("memory", "Memory by component", _plot_memory(records, decision, plt)))
    figures.append(("throughput", "Throughput", _plot_throughput(decision, colors, plt)))
    images: list[tuple[str, str, Path, bytes]] = []
    for key, title, fig in figures:
        path = plots_dir / f"{key}.png"
        images.append((key, title, path, _save(fig, path, plt)))

    headers = [h if h != "metric" else metric_name for h in _HEADERS]
    rows = _rows(decision, records)
    findings = {
        k: v for k, v in _findings(records, [s.policy for s in decision.summaries]).items() if v
    }
    observations = [*notes, *_observations(records, decision)]
    title = f"mixprec compare: {contract.workload}"
    verdict = headline(decision)
    gates = contract.gates
    gate_text = (
        f"held-out loss gap per seed, paired with {contract.baseline}: eligible when its "
        f"{gates.confidence:.0%} t-interval lies at or below {gates.max_rel_loss_gap:.2%}, "
        "rejected when above, inconclusive otherwise (more seeds, up to "
        f"{contract.seed_limit}); judged only when {contract.baseline} improved >= "
        f"{gates.improvement_floor:.2%} from step 0 and its last fifth <= {gates.tail_limit:.2%}; "
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
    setting_text = ", ".join(f"{k} {v}" for k, v in (settings or {}).items())

    md = [f"# {title}", "", workload_description, "", verdict, ""]
    md += [
        f"Settings: {setting_text}; seeds {contract.seeds} (up to {contract.seed_limit}).",
        "",
        f"Gates: {gate_text}.",
        "",
    ]
    md += ["## Decision", "", _md_table(headers, rows), ""]
    md += [
        "Memory is measured on one training step (parameters, gradients, master, moments, "
        "tensors saved for backward). *frozen*: share of parameter elements still at their "
        "initial value at the end.",
        "",
    ]
    if observations:
        md += ["## What the data show", ""] + [f"- {o}" for o in observations] + [""]
    md += ["## Plots", ""]
    md += [f"![{t}](plots/{p.name})" for _, t, p, _ in images] + [""]
    md += ["## Doctor", ""]
    if not findings:
        md += ["No findings.", ""]
    for policy, fs in findings.items():
        md += [f"### {policy}", ""]
        for f in fs:
            md += [
                f"- **{f.get('rule')}** ({f.get('severity')}, {f.get('where', '')}): "
                f"{f.get('message', '')} Fix: {f.get('fix', '')}"
            ]
        md.append("")
    md_path = out_dir / "report.md"
    md_path.write_text("\n".join(md), encoding="utf-8")

    html_path = out_dir / "report.html"
    html_path.write_text(
        _html(
            title,
            workload_description,
            verdict,
            setting_text,
            contract,
            gate_text,
            headers,
            rows,
            decision,
            observations,
            images,
            findings,
        ),
        encoding="utf-8",
    )
    return Report(
        results_json=results_path,
        markdown=md_path,
        html=html_path,
        plots=tuple(p for _, _, p, _ in images),
    )


_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2em auto;
max-width:1100px;
color:#222;padding:0 1em}
h1{font-size:1.5em;margin-bottom:.2em}
h2{font-size:1.15em;margin-top:1.6em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:.85em;width:100%}
th,td{border:1px solid #ddd;padding:4px 6px;text-align:left;vertical-align:top}
th{background:#f4f4f4}tr.rec td{background:#e8f6e8;font-weight:600}
tr.rejected td{color:#777}tr.inconclusive td,tr.too_short td{background:#fdf6e3}
tr.base td{background:#f4f7fc}.verdict{font-size:1.15em;margin:.6em 0;padding:.5em .8em;
background:#eef6ee;border-left:4px solid #3a3}.fail{background:#fbeeee;border-left-color:#c33}
.muted{color:#666;font-size:.9em}img{max-width:100%;border:1px solid #eee;margin:.4em 0}
.sev-error{color:#b00;font-weight:600}.sev-warning{color:#a60}.sev-info{color:#357}
.grid{display:grid;grid-template-columns:1fr 1fr;gap:.8em}
"""


def _html(
    title: str,
    description: str,
    verdict: str,
    setting_text: str,
    contract: Contract,
    gate_text: str,
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    decision: Decision,
    observations: Sequence[str],
    images: Sequence[tuple[str, str, Path, bytes]],
    findings: Mapping[str, Sequence[Mapping[str, Any]]],
) -> str:
    e = html.escape
    verdict_html = e(verdict).replace("**", "")
    cls = "verdict" if decision.recommended else "verdict fail"
    out = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>{e(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{e(title)}</h1><p class='muted'>{e(description)}</p>",
        f"<div class='{cls}'>{verdict_html}</div>",
        f"<p class='muted'>Settings: {e(setting_text)}; seeds {contract.seeds} "
        f"(up to {contract.seed_limit}).<br>"
        f"Gates: {e(gate_text)}.</p>",
        "<h2>Decision</h2><table><tr>" + "".join(f"<th>{e(h)}</th>" for h in headers) + "</tr>",
    ]
    for s, r in zip(decision.summaries, rows, strict=True):
        v = decision.verdicts.get(s.policy)
        klass = (
            "base"
            if s.policy == decision.baseline
            else "rec"
            if s.policy == decision.recommended
            else (v.status if v is not None else "")
        )
        out.append(f"<tr class='{klass}'>" + "".join(f"<td>{e(c)}</td>" for c in r) + "</tr>")
    out.append(
        "</table><p class='muted'>gap: mean over seeds of the relative held-out loss "
        "difference to the baseline on the same seed, with its t-interval in brackets; the "
        "baseline row gives its own seed spread. Memory: measured on one training step. "
        "frozen: parameter elements still at their initial value at the end.</p>"
    )
    if observations:
        out.append("<h2>What the data show</h2><ul>")
        out += [f"<li>{e(o).replace('`', '')}</li>" for o in observations]
        out.append("</ul>")
    out.append("<h2>Plots</h2>")
    for _, t, _, data in images:
        b64 = base64.b64encode(data).decode("ascii")
        out.append(f"<figure><img alt='{e(t)}' src='data:image/png;base64,{b64}'></figure>")
    out.append("<h2>Doctor</h2>")
    if not findings:
        out.append("<p>No findings.</p>")
    for policy, fs in findings.items():
        out.append(f"<h3>{e(policy)}</h3><ul>")
        for f in fs:
            sev = str(f.get("severity", "info"))
            out.append(
                f"<li><span class='sev-{e(sev)}'>{e(str(f.get('rule')))}</span> ({e(sev)}, "
                f"{e(str(f.get('where', '')))}): {e(str(f.get('message', '')))}"
                f"<br><i>Fix:</i> {e(str(f.get('fix', '')))}</li>"
            )
        out.append("</ul>")
    out.append("</body></html>")
    return "\n".join(out)
