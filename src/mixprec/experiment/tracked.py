"""What `compare` and `train` log to a tracker (`mixprec.tracking`): MLflow or TensorBoard.

compare: one parent run per experiment, holding the contract and the resolved
training settings as params, the decision (``mixprec.recommended``,
``mixprec.status`` (recommended, stay, pending_target, none), the objective and
why nothing was promoted when that is so, and per
candidate ``verdict.<policy>``, ``verdict.<policy>.gate`` and ``.reason`` as tags;
every number of each policy's summary as a ``<policy>.<figure>`` metric, with
``<policy>.memory_ratio`` and ``<policy>.time_ratio``, paired per seed) and
the report as artifacts; under it one nested run per (policy, seed) with the
policy's fields as params, the per-step figures of `runner.run_one` as metrics,
the record's final figures, and the run record as an artifact. A run reused from
an earlier invocation is logged from its record (its curves are the record's,
downsampled) and tagged ``mixprec.reused``.

train: one run with the policy's fields, the recipe and the resolved settings as
params, every line of ``metrics.jsonl`` as metrics at its step, the newest
checkpoint's path as the ``mixprec.checkpoint`` tag (checkpoints are not
uploaded), and ``train.json`` and ``recipe.json`` as artifacts. The run's id is
kept in ``OUT/tracking.json``, so that ``--resume`` goes on with the same run.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mixprec.experiment.contract import Contract
from mixprec.experiment.orchestration import RunFn
from mixprec.experiment.plan import RunSettings, settings_dict
from mixprec.experiment.records import RunRecord, record_path, write_json_atomic
from mixprec.policy import preset
from mixprec.tracking import RunStatus, TrackedRun, Tracker

if TYPE_CHECKING:
    from mixprec.experiment.decision import Decision
    from mixprec.experiment.report import Report
    from mixprec.policy import Policy
    from mixprec.workloads import Workload

__all__ = ["TRACKING_FILE", "CompareTracking", "TrainTracking", "status_of"]

#: In a `train` output folder: which tracker run the folder's run is logged to.
TRACKING_FILE = "tracking.json"


def status_of(exc: BaseException | None) -> RunStatus:
    """The run status an exception ends a run with (None: finished)."""
    if exc is None:
        return "FINISHED"
    return "KILLED" if isinstance(exc, KeyboardInterrupt) else "FAILED"


def _record_metrics(record: RunRecord) -> dict[str, Any]:
    """The final figures of a run record, as metrics."""
    out: dict[str, Any] = {
        "final_train_loss": record.final_train_loss,
        "final_heldout_loss": record.heldout_loss,
        f"final_{record.metric_name or 'metric'}": record.metric,
        "nonfinite_steps": record.nonfinite_steps,
        "skipped_steps": record.skipped_steps,
        "wall_time_s": record.wall_time_s,
    }
    out.update(record.throughput)
    out.update({f"memory_bytes.{k}": v for k, v in record.bytes.items()})
    out.update({f"predicted_bytes.{k}": v for k, v in record.predicted_bytes.items()})
    out.update({f"frozen_fraction.{k}": v for k, v in record.frozen_fraction.items()})
    return out


class CompareTracking:
    """The tracker runs of one `compare` invocation.

    Args:
        tracker: where to log.
        contract: the experiment.
        out_dir: its output folder (records and report are logged from it).
    """

    def __init__(self, tracker: Tracker, contract: Contract, out_dir: Path) -> None:
        self.contract = contract
        self.out_dir = out_dir
        self.parent = tracker.start_run(
            f"compare-{contract.workload}",
            tags={
                "mixprec.command": "compare",
                "mixprec.workload": contract.workload,
                "mixprec.baseline": contract.baseline,
                "mixprec.out": str(out_dir.resolve()),
            },
        )
        self.parent.log_params({"contract": contract.to_dict()})
        self._settings_logged = False
        self._open: dict[tuple[str, int], TrackedRun] = {}

    @property
    def where(self) -> str:
        """Where the experiment is logged (empty when tracking failed to start)."""
        return self.parent.where

    def log_settings(self, settings: RunSettings) -> None:
        """The resolved training settings on the parent (once)."""
        if not self._settings_logged:
            self._settings_logged = True
            self.parent.log_params({"settings": settings_dict(settings)})

    def _child(self, policy: str, seed: int, **tags: str) -> TrackedRun:
        return self.parent.child(
            f"{policy}-seed{seed}",
            tags={"mixprec.policy": policy, "mixprec.seed": str(seed), **tags},
        )

    def wrap(self, run: Callable[..., RunRecord]) -> RunFn:
        """`run` (`runner.run_one`) with a nested run that gets its params and its
        per-step figures (`on_step`); `on_record` ends it."""

        def tracked(
            workload: Workload,
            policy_name: str,
            seed: int,
            settings: RunSettings,
            **kw: Any,
        ) -> RunRecord:
            self.log_settings(settings)
            child = self._child(policy_name, seed)
            pol: Policy = preset(policy_name)
            child.log_params(
                {
                    "policy": pol.name,
                    "seed": seed,
                    "steps": kw.get("run_steps") or settings.train.steps,
                    "schedule_steps": settings.train.steps,
                    "workload": workload.name,
                    "policy_fields": pol.to_dict(),
                }
            )

            def on_step(step: int, values: Mapping[str, float]) -> None:
                child.log_metrics(values, step=step)

            try:
                record = run(workload, policy_name, seed, settings, on_step=on_step, **kw)
            except BaseException as exc:
                child.end(status_of(exc))
                raise
            self._open[(record.policy, record.seed)] = child
            return record

        return tracked

    def on_record(self, record: RunRecord, reused: bool) -> None:
        """End the nested run of `record` (written to disk by now); a reused record
        gets a nested run logged from the record alone."""
        child = self._open.pop((record.policy, record.seed), None)
        if child is None:
            child = self._child(record.policy, record.seed, **{"mixprec.reused": "true"})
            child.log_params(
                {
                    "policy": record.policy,
                    "seed": record.seed,
                    "steps": record.steps,
                    "schedule_steps": record.schedule_steps,
                    "workload": record.workload,
                    "policy_fields": dict(record.policy_fields),
                }
            )
            for step, loss in record.loss_curve:
                child.log_metrics({"train_loss": loss}, step=int(step) + 1)
            for step, loss in record.eval_curve:
                child.log_metrics({"heldout_loss": loss}, step=int(step))
            for step, scale in record.loss_scale_trace:
                child.log_metrics({"loss_scale": scale}, step=int(step))
        child.log_metrics(_record_metrics(record), step=record.steps)
        tags = {"mixprec.status": record.status}
        if record.error:
            tags["mixprec.error"] = record.error
        if record.doctor_rules:
            tags["mixprec.doctor_rules"] = ",".join(record.doctor_rules)
        child.set_tags(tags)
        path = record_path(self.out_dir, record.policy, record.seed)
        if path.is_file():
            child.log_artifact(path)
        child.end("FINISHED" if record.ok else "FAILED")

    def finish(self, decision: Decision, report: Report, settings: RunSettings) -> None:
        """Log the decision and the report on the parent run and end it."""
        self.log_settings(settings)
        data = decision.to_dict()
        tags: dict[str, str] = {
            "mixprec.recommended": str(data.get("recommended") or "none"),
            "mixprec.success": str(decision.success).lower(),
            "mixprec.status": decision.status,
            "mixprec.objective": decision.objective,
            "mixprec.ranked_by": decision.ranked_by,
        }
        for key in (
            "too_short",
            "baseline_reason",
            "pending",
            "speed_note",
            "baseline_note",
            "target_device",
            "fp8_reference",
            "fp8_note",
        ):
            if data.get(key):
                tags[f"mixprec.{key}"] = str(data[key])
        policies: Mapping[str, Any] = data.get("policies") or {}
        metrics: dict[str, Any] = {}
        for name, entry in policies.items():
            verdict = entry.get("verdict")
            if isinstance(verdict, Mapping):
                tags[f"verdict.{name}"] = str(verdict.get("status", ""))
                tags[f"verdict.{name}.gate"] = str(verdict.get("gate", ""))
                tags[f"verdict.{name}.reason"] = str(verdict.get("reason", ""))
            for key, value in entry.items():
                if isinstance(value, int | float) and not isinstance(value, bool):
                    metrics[f"{name}.{key}"] = value
            for ratio in ("memory_ratio", "time_ratio"):  # paired per seed, their means
                paired = entry.get(ratio)
                if isinstance(paired, Mapping) and _number(paired.get("mean")):
                    metrics[f"{name}.{ratio}"] = paired["mean"]
        self.parent.set_tags(tags)
        self.parent.log_metrics(metrics, step=0)
        for path in (report.results_json, report.markdown, report.html):
            if path.is_file():
                self.parent.log_artifact(path)
        contract_file = self.out_dir / "contract.json"
        if contract_file.is_file():
            self.parent.log_artifact(contract_file)
        folders = {p.parent for p in report.plots if p.is_file()}
        for folder in sorted(folders):
            self.parent.log_artifact(folder)
        self.parent.end("FINISHED")

    def abort(self, exc: BaseException) -> None:
        """End every open run after `exc` stopped the experiment."""
        for child in self._open.values():
            child.end(status_of(exc))
        self._open.clear()
        self.parent.end(status_of(exc))


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


class TrainTracking:
    """The tracker run of one `train` output folder (rank 0 only).

    Args:
        tracker: where to log.
        out: the output folder.
        start: the step this invocation goes on from (0: a new run).
        params: what the run is (policy fields, recipe, settings); logged by a new run.
        tags: tags set at every start.
    """

    def __init__(
        self,
        tracker: Tracker,
        out: Path,
        *,
        name: str,
        start: int,
        params: Mapping[str, Any],
        tags: Mapping[str, str],
    ) -> None:
        self.out = out
        previous = _stored(out / TRACKING_FILE, tracker) if start else None
        self.run = tracker.start_run(name, tags=tags, resume=previous, resume_step=start)
        if previous is not None and self.run.run_id == previous:
            self.run.set_tags({**tags, "mixprec.resumed_at": str(start)})
        else:
            self.run.log_params(params)
        if self.run.run_id:
            write_json_atomic(
                out / TRACKING_FILE,
                {"tracker": tracker.name, "uri": tracker.uri, "run_id": self.run.run_id},
            )

    @property
    def where(self) -> str:
        """Where the run is logged (empty when tracking failed to start)."""
        return self.run.where

    def step(self, line: Mapping[str, Any]) -> None:
        """One line of ``metrics.jsonl``."""
        self.run.log_metrics({k: v for k, v in line.items() if k != "step"}, step=line["step"])

    def checkpoint(self, path: Path) -> None:
        """The newest checkpoint (its path only: checkpoints are not uploaded)."""
        self.run.set_tags({"mixprec.checkpoint": str(path.resolve())})

    def finish(self, summary: Mapping[str, Any], files: tuple[Path, ...]) -> None:
        """The run's end: its status, final figures and summary files; stopped runs end
        KILLED (``--resume`` sets them running again)."""
        finished = summary.get("status") == "finished"
        final = summary.get("final") or {}
        self.run.set_tags({"mixprec.status": str(summary.get("status", ""))})
        self.run.log_metrics(
            {
                "final_eval_loss": final.get("eval_loss"),
                "final_eval_metric": final.get("eval_metric"),
                "skipped_steps": summary.get("skipped_steps"),
                "wall_time_s": summary.get("wall_time_s"),
                "steps_per_s": summary.get("steps_per_s"),
            },
            step=int(summary.get("step") or 0),
        )
        for path in files:
            if path.is_file():
                self.run.log_artifact(path)
        self.run.end("FINISHED" if finished else "KILLED")

    def abort(self, exc: BaseException) -> None:
        """End the run after `exc` stopped training."""
        self.run.end(status_of(exc))


def _stored(path: Path, tracker: Tracker) -> str | None:
    """The run id `path` names for this tracker and URI, else None."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(data, dict):
        return None
    if data.get("tracker") != tracker.name or data.get("uri") != tracker.uri:
        return None
    run_id = data.get("run_id")
    return run_id if isinstance(run_id, str) and run_id else None
