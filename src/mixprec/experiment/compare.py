"""`mixprec.compare`: the precision experiment as one library call.

Run (or resume) every run of a contract, add seeds while a candidate is
inconclusive, decide, and render the report. `mixprec compare` is this call
plus argument parsing and printing.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from mixprec.device import resolve_device
from mixprec.experiment.contract import TRAIN_KEYS, Contract, candidates_from
from mixprec.experiment.decision import Decision, decide, missing_runs
from mixprec.experiment.gates import Gates
from mixprec.experiment.plan import default_candidates
from mixprec.experiment.records import RunRecord, load_records
from mixprec.experiment.report import Report, render
from mixprec.experiment.runner import (
    CONTRACT_FILE,
    check_out_dir,
    run_experiment,
    run_one,
    settings_dict,
    settings_for,
)
from mixprec.experiment.tracked import CompareTracking
from mixprec.tracking import Tracker, guarded, open_tracker, tracker_failed
from mixprec.workloads import Workload

__all__ = [
    "Recommendation",
    "Rerendered",
    "Results",
    "compare",
    "recommendation",
    "records_of",
    "rerender",
    "run_contract",
    "stored_experiment",
]


@dataclass(frozen=True, kw_only=True)
class Results:
    """What an experiment produced.

    Attributes:
        contract: the contract that ran.
        workload: the workload object.
        records: every run record, in the order the runs happened.
        decision: the verdicts and the recommendation.
        report: paths of results.json, report.md, report.html and the plots.
        out_dir: the folder holding all of it.
        tracked: where the experiment was logged (tracker URI and run id, or the
            TensorBoard log dir); empty when it was not tracked or tracking failed.
    """

    contract: Contract
    workload: Workload
    records: tuple[RunRecord, ...]
    decision: Decision
    report: Report
    out_dir: Path
    tracked: str = ""

    @property
    def recommended(self) -> str | None:
        """The recommended policy, or None."""
        return self.decision.recommended


def run_contract(
    contract: Contract,
    out_dir: Path,
    *,
    device: str = "cpu",
    allow_import: bool = False,
    stream: TextIO | None = sys.stderr,
    on_record: Callable[[RunRecord, bool], None] | None = None,
    workload: Workload | None = None,
    should_stop: Callable[[], bool] | None = None,
    tracker: Tracker | None = None,
    notes: Sequence[str] = (),
) -> Results:
    """Run `contract` into `out_dir`, decide, and render the report (see `run_experiment`).

    With a `tracker` (`mixprec.tracking.open_tracker`), the experiment is logged as
    it goes: see `mixprec.experiment.tracked`. `notes` (how the contract was
    resolved, e.g. `plan.default_candidates`) are printed to `stream` first and
    listed in the report and results.json.
    """
    if stream is not None:
        for note in notes:
            print(f"  {note}", file=stream)
    tracking = None
    run = None
    if tracker is not None:
        tracker = guarded(tracker)
        check_out_dir(out_dir)  # before a tracker run is started for it
        tracking = CompareTracking(tracker, contract, out_dir)
        if stream is not None and tracking.where:
            print(f"  tracking: {tracking.where}", file=stream)
        run = tracking.wrap(run_one)
        on_record = _chain(tracking.on_record, on_record)
    try:
        wl, records = run_experiment(
            contract,
            out_dir,
            device=device,
            allow_import=allow_import,
            stream=stream,
            on_record=on_record,
            workload=workload,
            should_stop=should_stop,
            run=run,
        )
        decision = decide(
            records,
            contract,
            higher_is_better=wl.higher_is_better,
            stands_for=wl.defaults.steps,
        )
        run_settings = settings_for(contract, wl)
        report = render(
            out_dir,
            contract,
            records,
            decision,
            workload_description=wl.description,
            metric_name=wl.metric_name,
            higher_is_better=wl.higher_is_better,
            settings=settings_dict(run_settings),
            notes=notes,
        )
    except BaseException as exc:
        if tracking is not None:
            tracking.abort(exc)
        raise
    if tracking is not None:
        tracking.finish(decision, report, run_settings)
    return Results(
        contract=contract,
        workload=wl,
        records=tuple(records),
        decision=decision,
        report=report,
        out_dir=out_dir,
        tracked="" if tracking is None or tracker_failed(tracker) else tracking.where,
    )


def _chain(
    first: Callable[[RunRecord, bool], None], then: Callable[[RunRecord, bool], None] | None
) -> Callable[[RunRecord, bool], None]:
    def both(record: RunRecord, reused: bool) -> None:
        first(record, reused)
        if then is not None:
            then(record, reused)

    return both


def compare(
    workload: str | Workload = "shakespeare",
    policies: Sequence[str] | str | None = None,
    *,
    seeds: int = 2,
    steps: int | None = None,
    out: str | Path | None = None,
    device: str = "cpu",
    progress: bool = True,
    track: str | Tracker | None = None,
    track_uri: str | None = None,
    **contract: Any,
) -> Results:
    """Train a baseline and candidate policies on `workload`, judge them, and report.

    Args:
        workload: a built-in workload name, a ``module:function`` spec (imported:
            this call is a person asking), or a `Workload` object.
        policies: candidate policies (a list or a comma-separated string); the
            baseline is dropped from it. None: the default candidates
            (`plan.default_candidates`: without the fp16 ones where fp16 matmuls are
            not accelerated, unless ``step_caps`` is given).
        seeds: seeds every policy runs; candidates neither rejected nor eligible get
            more, up to ``max_seeds``, where eligibility is judged once.
        steps: optimizer steps per run (None: the workload's default).
        out: the output folder (None: a new temporary folder).
        device: the device to train on.
        progress: show progress bars and per-run lines on stderr.
        track: log the experiment to ``"mlflow"`` or ``"tensorboard"`` (or a
            `mixprec.tracking.Tracker`); None: not tracked.
        track_uri: the MLflow tracking URI or the TensorBoard log dir (None:
            ``MLFLOW_TRACKING_URI`` or ``./mlruns``; ``out/tensorboard``).
        **contract: any other `Contract` field (``baseline``, ``size``, ``lr``,
            ``max_seeds``, ``allow``, ``step_caps``...) and ``gates`` (a `Gates`
            or a mapping of its fields).

    Returns:
        The `Results`; ``results.recommended`` is the policy to promote, or None.

    Raises:
        ValueError: an invalid contract, naming the value and the valid choices.
        ImportError: the tracker's package is not installed.
    """
    fields: dict[str, Any] = dict(contract)
    gates = fields.get("gates")
    if gates is not None and not isinstance(gates, Gates):
        if not isinstance(gates, Mapping):
            raise ValueError(f"gates must be a Gates or a mapping, got {gates!r}")
        fields["gates"] = dict(gates)
    if isinstance(workload, Workload):
        fields["workload"] = workload.name
        workload_obj: Workload | None = workload
    else:
        fields["workload"] = workload
        workload_obj = None
    fields["seeds"] = seeds
    fields["steps"] = steps
    if policies is not None:
        fields["candidates"] = candidates_from(policies, fields.get("baseline", "fp32"))
    fields, note = default_candidates(fields, str(resolve_device(device)))
    plain = {k: v for k, v in fields.items() if k != "gates"}
    if "gates" in fields and isinstance(fields["gates"], Gates):
        built = Contract.from_dict(plain)
        built = dataclasses.replace(built, gates=fields["gates"])
    else:
        built = Contract.from_dict(fields)
    out_dir = Path(out) if out is not None else Path(tempfile.mkdtemp(prefix="mixprec-compare-"))
    tracker = open_tracker(track, out=out_dir, uri=track_uri) if isinstance(track, str) else track
    return run_contract(
        built,
        out_dir,
        device=device,
        allow_import=workload_obj is None and ":" in str(workload),
        stream=sys.stderr if progress else None,
        workload=workload_obj,
        tracker=tracker,
        notes=(note,) if note else (),
    )


def stored_experiment(folder: Path) -> dict[str, Any]:
    """What an experiment folder says it is: contract.json (written when a compare
    starts, so it is the latest contract, also of an interrupted rerun), else
    results.json (folders written before contract.json existed).

    Raises:
        FileNotFoundError: neither file exists.
        ValueError: the file is not JSON or holds no contract object.
    """
    for name in (CONTRACT_FILE, "results.json"):
        path = folder / name
        if path.is_file():
            return _contract_file(path)
    raise FileNotFoundError(
        f"{folder} has neither results.json nor contract.json (is it a mixprec compare folder?)"
    )


def _contract_file(path: Path) -> dict[str, Any]:
    """The JSON object of `path`, which holds a ``contract`` object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict) or not isinstance(data.get("contract"), dict):
        raise ValueError(f"{path} holds no contract object; is it a mixprec compare folder?")
    return data


@dataclass(frozen=True, kw_only=True)
class Recommendation:
    """What a finished experiment folder recommends (`recommendation`)."""

    policy: str | None
    """The recommended policy, None when nothing was recommended."""
    why_none: str
    """Why nothing was recommended (empty when a policy was)."""
    workload: str
    """The workload the experiment ran."""
    size: str | None
    """Its size preset (None: the workload's default for a contract)."""
    train: Mapping[str, object] = dataclasses.field(default_factory=dict)
    """The contract's overrides of the workload's `TrainSettings`, by field name (those
    it left unset are not listed)."""
    optimizer: str = "adamw"
    """The optimizer the runs trained with."""
    optimizer_args: Mapping[str, object] = dataclasses.field(default_factory=dict)
    """Its own keyword arguments."""


def recommendation(folder: str | Path) -> Recommendation:
    """The policy a finished `compare` folder recommends, read from its results.json
    (`mixprec train --policy-from`).

    Raises:
        FileNotFoundError: no results.json (compare did not finish there).
        ValueError: results.json is not valid JSON or not compare's.
    """
    path = Path(folder) / "results.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} does not exist: is {folder} the --out folder of a finished mixprec compare?"
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON: {str(exc).splitlines()[0]}") from None
    decision = data.get("decision") if isinstance(data, dict) else None
    contract = data.get("contract") if isinstance(data, dict) else None
    if not isinstance(decision, dict) or not isinstance(contract, dict):
        raise ValueError(f"{path} holds no decision; is it a mixprec compare folder?")
    latest = Path(folder) / CONTRACT_FILE
    if latest.is_file() and _contract_file(latest)["contract"] != contract:
        raise ValueError(
            f"{path} was judged under another contract than {latest} (a later compare into "
            f"{folder} did not finish): rerun that compare to finish it, or run mixprec "
            f"report {folder} to judge the stored runs under it"
        )
    policy = decision.get("recommended")
    if policy is not None and not isinstance(policy, str):
        raise ValueError(f"{path}: recommended must be a policy name, got {policy!r}")
    compared = [contract.get("baseline"), *(contract.get("candidates") or [])]
    if policy is not None and policy not in compared:
        raise ValueError(
            f"{path}: recommends {policy!r}, which its contract did not compare "
            f"({', '.join(map(str, compared))}); an edited file? rerun compare"
        )
    why = ""
    if policy is None:
        why = str(
            decision.get("incomplete")
            or decision.get("too_short")
            or decision.get("baseline_reason")
            or (
                f"pending a run on the target: {decision['pending']}"
                if decision.get("pending")
                else ""
            )
            or decision.get("speed_note")
            or "no candidate passed the gates"
        )
    size = contract.get("size")
    args = contract.get("optimizer_args")
    return Recommendation(
        policy=policy,
        why_none=why,
        workload=str(contract.get("workload", "")),
        size=size if isinstance(size, str) else None,
        train={k: contract[k] for k in TRAIN_KEYS if contract.get(k) is not None},
        optimizer=str(contract.get("optimizer", "adamw")),
        optimizer_args=dict(args) if isinstance(args, Mapping) else {},
    )


def records_of(contract: Contract, folder: Path) -> tuple[list[RunRecord], list[str]]:
    """The folder's run records of `contract` (its policies, seeds and settings) in the
    order `compare` runs them (by seed, baseline first), and a note for each record
    skipped or ignored and for the runs that are missing.

    A rerun with other settings that was interrupted can leave records of both side by
    side; only those whose fingerprint matches the contract are used.
    """
    found, skipped, trace_notes = load_records(folder)
    order = {name: i for i, name in enumerate(contract.policies)}
    records = sorted(
        (
            r
            for r in found
            if r.policy in contract.policies
            and r.fingerprint == contract.run_fingerprint(r.policy, r.seed, r.steps)
        ),
        key=lambda r: (r.seed, order[r.policy]),
    )
    notes = [f"skipped a bad record: {line}" for line in skipped] + trace_notes
    ignored = len(found) - len(records)
    if ignored:
        notes.append(f"ignored {ignored} record(s) of other policies or settings")
    missing = missing_runs(records, contract)
    if missing:
        notes.append(f"missing runs (rerun compare to train them): {', '.join(missing)}")
    return records, notes


@dataclass(frozen=True, kw_only=True)
class Rerendered:
    """A report re-rendered from a folder (`rerender`)."""

    contract: Contract
    records: tuple[RunRecord, ...]
    decision: Decision
    report: Report
    metric_name: str
    notes: tuple[str, ...]


def rerender(folder: str | Path) -> Rerendered:
    """Re-judge and re-render an experiment folder from its stored records, without
    training (`mixprec report`; also `mixprec.report(folder)`).

    Raises:
        FileNotFoundError, ValueError: not an experiment folder, or no record of its
            contract.
    """
    folder = Path(folder)
    stored = stored_experiment(folder)
    contract = Contract.from_dict(stored["contract"])
    records, notes = records_of(contract, folder)
    if not records:
        raise ValueError(f"{folder / 'runs'} holds no run records of this contract")
    higher = bool(stored.get("higher_is_better", True))
    metric_name = str(stored.get("metric_name", "metric"))
    steps = stored.get("workload_steps")
    decision = decide(
        records,
        contract,
        higher_is_better=higher,
        stands_for=steps if isinstance(steps, int) and not isinstance(steps, bool) else None,
    )
    settings = stored.get("settings")
    report = render(
        folder,
        contract,
        records,
        decision,
        workload_description=str(stored.get("workload_description", "")),
        metric_name=metric_name,
        higher_is_better=higher,
        settings=settings if isinstance(settings, dict) else None,
        notes=notes,
    )
    return Rerendered(
        contract=contract,
        records=tuple(records),
        decision=decision,
        report=report,
        metric_name=metric_name,
        notes=tuple(notes),
    )
