"""`mixprec compare`: the precision experiment (runs, gates, decision, report)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from mixprec.cli.common import add_optimizer_flags, load_mapping
from mixprec.cli.interrupt import INTERRUPTED
from mixprec.cli.tracking import add_track_flags, check_track, tracker_from_args

__all__ = ["add_parser", "out_folder", "outcome"]


def add_parser(sub: Any) -> None:
    """Register the ``compare`` subcommand."""
    p = sub.add_parser(
        "compare",
        help="the precision experiment: train policies on a workload, gate, decide, report",
        description="Train a baseline and candidate policies on the same data and initial "
        "weights, judge candidates with quality gates, recommend one, write a report.",
    )
    p.add_argument(
        "--workload", default=None, help="shakespeare (default), digits, or module:function"
    )
    p.add_argument(
        "--size", default=None, help="the workload's size preset (e.g. tiny, small, default)"
    )
    p.add_argument("--baseline", default=None, help="the reference policy (default fp32)")
    p.add_argument("--policies", default=None, help="comma-separated candidate policies")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per run")
    p.add_argument("--seeds", type=int, default=None, help="number of seeds (default 2)")
    p.add_argument(
        "--max-seeds",
        type=int,
        default=None,
        help="the seeds at which eligibility is judged, once: candidates not yet rejected "
        "(and the baseline) get seeds up to it (default max(seeds, 5))",
    )
    p.add_argument(
        "--max-rel-loss-gap",
        type=float,
        default=None,
        help="largest accepted relative held-out loss gap to the baseline (default 0.005); "
        "sets gates.max_rel_loss_gap",
    )
    p.add_argument(
        "--allow",
        default=None,
        help="comma-separated doctor rule ids acknowledged: their update-path errors no "
        "longer reject a candidate (shown in the report)",
    )
    p.add_argument("--lr", type=float, default=None, help="peak learning rate")
    p.add_argument(
        "--min-lr", type=float, default=None, help="final learning rate of the cosine decay"
    )
    p.add_argument("--batch-size", type=int, default=None, help="examples per step")
    add_optimizer_flags(p)
    p.add_argument(
        "--objective",
        default=None,
        help="what the recommendation optimizes among the baseline and the eligible "
        "candidates: memory, speed or balanced (default: memory x step time vs the baseline)",
    )
    p.add_argument(
        "--memory-budget",
        default=None,
        help="most measured training memory a recommendation may use: bytes or a size "
        "with a unit (6GiB, '512 MiB', 8GB); candidates over it are rejected",
    )
    p.add_argument(
        "--max-slowdown",
        default=None,
        help="largest step time relative to the baseline's a recommendation may take "
        "(e.g. 1.5); candidates over it are rejected",
    )
    p.add_argument(
        "--target-device",
        default=None,
        help="the hardware the policy will train on: cpu, cuda, mps, xpu, gpu or words of "
        "a device name (H100); runs measured elsewhere leave the decision pending",
    )
    p.add_argument(
        "--baseline-for-fp8",
        default=None,
        help="the 16-bit candidate FP8 candidates must also match (default: the best "
        "eligible 16-bit candidate under the objective)",
    )
    p.add_argument("--config", type=Path, default=None, help="a YAML contract; flags override it")
    p.add_argument("--out", type=out_folder, default=Path("runs/compare"), help="output folder")
    p.add_argument("--device", default="cpu", help="device to train on (default cpu)")
    add_track_flags(p)
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument(
        "--json",
        action="store_true",
        help='no progress; print results.json to stdout, with where --track logged it ("tracked")',
    )
    p.set_defaults(handler=run)


def _load_yaml_contract(path: Path) -> dict[str, Any]:
    data = load_mapping(path, "a contract (a YAML mapping)")
    data = data.get("compare", data)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: 'compare' must be a mapping")
    return data


def _contract_from_args(args: argparse.Namespace) -> tuple[Any, str]:
    """The contract of the flags and ``--config``, and the note of
    `plan.default_candidates` ("" when the candidates were named or all kept)."""
    from mixprec.device import resolve_device
    from mixprec.experiment.contract import Contract, candidates_from
    from mixprec.experiment.plan import default_candidates

    data: dict[str, Any] = _load_yaml_contract(args.config) if args.config else {}
    flagged: set[str] = set()  # keys given by flags (they override the file's)
    if args.workload is None and "workload" in data and ":" in str(data["workload"]):
        raise ValueError(
            f"contract file names workload {data['workload']!r}: files may only name built-in "
            "workloads (a module:function would run code); pass --workload on the command line"
        )
    for flag, key in (
        ("workload", "workload"),
        ("size", "size"),
        ("baseline", "baseline"),
        ("steps", "steps"),
        ("seeds", "seeds"),
        ("max_seeds", "max_seeds"),
        ("allow", "allow"),
        ("lr", "lr"),
        ("min_lr", "min_lr"),
        ("batch_size", "batch_size"),
        ("objective", "objective"),
        ("memory_budget", "memory_budget"),
        ("max_slowdown", "max_slowdown"),
        ("target_device", "target_device"),
        ("baseline_for_fp8", "baseline_for_fp8"),
        ("optimizer", "optimizer"),
        ("optimizer_args", "optimizer_args"),
    ):
        value = getattr(args, flag)
        if value is not None:
            data[key] = value
            flagged.add(key)
    if args.policies is not None:
        data["candidates"] = candidates_from(args.policies, data.get("baseline", "fp32"))
        flagged.add("candidates")
    if args.max_rel_loss_gap is not None:
        gates = data.setdefault("gates", {})
        if isinstance(gates, dict):  # otherwise the contract refuses the file's gates
            gates["max_rel_loss_gap"] = args.max_rel_loss_gap
        flagged.add("max_rel_loss_gap")
    data, note = default_candidates(data, str(resolve_device(args.device)))
    try:
        return Contract.from_dict(data), note
    except ValueError as exc:
        # Name the file when the bad value came from it (errors start with the key).
        if args.config is not None and str(exc).split(" ", 1)[0] not in flagged:
            raise ValueError(f"{args.config}: {exc}") from None
        raise


def run(args: argparse.Namespace) -> int:
    """Run the experiment the flags (and ``--config``) describe; 1 when none is recommended."""
    from mixprec.experiment.compare import run_contract
    from mixprec.experiment.plan import settings_for
    from mixprec.experiment.report import render_summary
    from mixprec.experiment.runner import check_out_dir, workload_options
    from mixprec.workloads import load_workload

    # Everything that can be refused is checked before any output: one line.
    contract, note = _contract_from_args(args)  # resolves --device too
    check_track(args)
    allow_import = args.workload is not None and ":" in args.workload
    workload = load_workload(
        contract.workload, allow_import=allow_import, **workload_options(contract)
    )
    settings_for(contract, workload).check_release(contract.policies)
    check_out_dir(args.out)  # after the workload: a refused one leaves no folder behind
    out: Path = args.out
    stream = None if args.quiet or args.json else sys.stderr  # as train: --json is quiet
    started = time.perf_counter()

    if stream is not None:
        print(
            f"mixprec compare: {contract.workload} ({contract.size or 'default size'}), "
            f"baseline {contract.baseline}, "
            f"optimizer {contract.optimizer_label}, "
            f"candidates {', '.join(contract.candidates)}, {contract.seeds} seed(s) "
            f"(up to {contract.seed_limit}) -> {out}",
            file=stream,
        )
    results = run_contract(
        contract,
        out,
        device=args.device,
        allow_import=allow_import,
        stream=stream,
        workload=workload,
        should_stop=INTERRUPTED.is_set,
        tracker=tracker_from_args(args, out),
        notes=(note,) if note else (),
    )
    decision = results.decision
    if args.json:
        data = json.loads(results.report.results_json.read_text(encoding="utf-8"))
        data["tracked"] = results.tracked or None  # where --track logged it, as the text says
        sys.stdout.write(json.dumps(data, indent=1) + "\n")
    else:
        print(render_summary(results.report.view))
        print()
        print(
            f"{outcome(decision)}  ({time.perf_counter() - started:.0f}s)  "
            f"report: {results.report.html}"
        )
        if results.tracked:
            print(f"tracked: {results.tracked}")
    return 0 if decision.success else 1


def outcome(decision: Any) -> str:
    """The last line: ``recommended: X``, ``recommended: stay on fp32``, ``pending a run
    on cuda (recommended: none)`` or ``recommended: none``; with ``for optimizer sgd
    (momentum=0.9)`` after it when the runs did not train with the default AdamW."""
    if decision.status == "stay":
        text = f"recommended: stay on {decision.recommended}"
    elif decision.status == "pending_target":
        text = f"recommended: none, pending a run on {decision.target_device}"
    else:
        text = f"recommended: {decision.recommended or 'none'}"
    optimizer = decision.optimizer
    return text if optimizer == "adamw" else f"{text} for optimizer {optimizer}"


def out_folder(text: str) -> Path:
    """An ``--out`` folder; an empty string (an unset shell variable) is refused."""
    if not text.strip():
        raise argparse.ArgumentTypeError(
            "is empty (an unset shell variable?): give a folder, e.g. --out runs/exp1"
        )
    return Path(text)
