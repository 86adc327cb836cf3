"""Run records: everything one training run produced, as plain JSON-ready data.

Records are written as each run finishes (atomically: a crash never leaves half
a file), so an interrupted experiment resumes where it stopped and a report can
be re-rendered from the folder alone.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["RunRecord", "read_records", "record_path", "write_json_atomic"]


@dataclass(frozen=True, kw_only=True)
class RunRecord:
    """One policy trained with one seed.

    Attributes:
        workload: the workload name; size: its size preset.
        policy: the policy name; policy_fields: every field of the policy
            (compute, storage, master, moments, reduce dtypes, loss scaling...).
        seed: the seed (initial weights and data order).
        steps: optimizer steps attempted (fewer than `schedule_steps` for a capped run).
        schedule_steps: the length of the learning-rate schedule (the full run).
        fingerprint: hash of the settings that determine this run (resume key).
        status: ``ok``, or ``failed`` when training stopped early (`error` says why).
        final_train_loss: mean training loss over the last 10% of steps.
        heldout_loss, metric, metric_name: the final held-out evaluation.
        nonfinite_steps: steps whose loss was inf/NaN.
        skipped_steps: optimizer steps skipped (non-finite gradients).
        loss_curve: ``[step, train loss]`` pairs (downsampled to at most 400).
        eval_curve: ``[step, held-out loss]`` pairs.
        loss_scale_trace: ``[step, scale]`` at every change, for scaled runs.
        bytes: measured memory by component (and total).
        predicted_bytes: the memory estimate for the same components.
        throughput: ``steps_per_s`` and ``examples_per_s`` (training loop only).
        wall_time_s: wall time of the run, evaluation included.
        frozen_fraction: share of parameter elements still equal to their initial
            value at the end, overall (``all``) and for norm gains (``norm``).
        probes: the doctor's runtime measurements (underflow and vanishing-update
            fractions, by their names).
        doctor: the doctor's findings for this configuration (static and runtime).
        effective: requested vs effective precision on this device.
        error: why a failed run stopped.
    """

    workload: str
    size: str
    policy: str
    policy_fields: Mapping[str, Any]
    seed: int
    steps: int
    fingerprint: str
    schedule_steps: int = 0
    status: str = "ok"
    final_train_loss: float = float("nan")
    heldout_loss: float = float("nan")
    metric: float = float("nan")
    metric_name: str = ""
    nonfinite_steps: int = 0
    skipped_steps: int = 0
    loss_curve: Sequence[Sequence[float]] = ()
    eval_curve: Sequence[Sequence[float]] = ()
    loss_scale_trace: Sequence[Sequence[float]] = ()
    bytes: Mapping[str, int] = field(default_factory=dict)
    predicted_bytes: Mapping[str, int] = field(default_factory=dict)
    throughput: Mapping[str, float] = field(default_factory=dict)
    wall_time_s: float = 0.0
    frozen_fraction: Mapping[str, float] = field(default_factory=dict)
    probes: Mapping[str, float] = field(default_factory=dict)
    doctor: Sequence[Mapping[str, Any]] = ()
    effective: Mapping[str, Any] = field(default_factory=dict)
    error: str = ""

    @property
    def doctor_rules(self) -> list[str]:
        """The rule ids of the doctor's findings, in order, without repeats."""
        seen: list[str] = []
        for f in self.doctor:
            rule = str(f.get("rule", ""))
            if rule and rule not in seen:
                seen.append(rule)
        return seen

    def heldout_at(self, step: int) -> float:
        """Held-out loss after `step` steps (NaN if this run was not evaluated there)."""
        if step == self.steps:
            return self.heldout_loss
        for s, loss in self.eval_curve:
            if int(s) == step:
                return float(loss)
        return float("nan")

    @property
    def ok(self) -> bool:
        """The run finished."""
        return self.status == "ok"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready data; includes ``doctor_rules`` for readers of results.json."""
        out = dataclasses.asdict(self)
        for key, value in out.items():
            if isinstance(value, tuple):
                out[key] = list(value)
        out["policy_fields"] = dict(self.policy_fields)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunRecord:
        """Inverse of `to_dict` (extra keys are ignored, so older readers keep working)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def record_path(out_dir: Path, policy: str, seed: int) -> Path:
    """Where the record of `policy` with `seed` lives."""
    return out_dir / "runs" / f"{policy}-seed{seed}.json"


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON to `path` atomically (temporary file, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1, allow_nan=True)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_records(out_dir: Path) -> list[RunRecord]:
    """Every run record in `out_dir/runs`, sorted by file name.

    Raises:
        ValueError: a record that is not valid JSON, naming the file.
    """
    records = []
    for path in sorted((out_dir / "runs").glob("*.json")):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ValueError(f"run record {path} is not valid JSON: {exc}") from exc
        records.append(RunRecord.from_dict(data))
    return records
