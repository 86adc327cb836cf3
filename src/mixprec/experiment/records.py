"""Run records: everything one training run produced, as plain JSON-ready data.

Records are written as each run finishes (atomically: a crash never leaves half
a file), so an interrupted experiment resumes where it stopped and a report can
be re-rendered from the folder alone.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mixprec.experiment.fp8_trace import Fp8Trace
from mixprec.experiment.hardware import DeviceFacts

__all__ = [
    "RunRecord",
    "load_records",
    "read_records",
    "record_path",
    "strict_json",
    "write_bytes_atomic",
    "write_json_atomic",
    "write_text_atomic",
]


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
        device: where the run was measured (CPU model and flags or GPU, torch
            version, threads); None in records written before mixprec recorded it.
        fp8_trace: runs with fp8 layers: each tensor's amax, scale, saturated and
            underflow fractions and the delayed-scaling what-if over the probe's
            sampled steps, worst tensors in full and the rest aggregated
            (`mixprec.experiment.fp8_trace`); None without fp8 layers and in
            records written before mixprec stored it (nothing is judged on it).
        error: why a failed run stopped.
        optimizer: the optimizer the run trained with and its own arguments
            (``sgd (momentum=0.9)``; its lr, weight decay and betas are the run's
            settings); ``adamw`` in records written before it was recorded.
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
    device: DeviceFacts | None = None
    fp8_trace: Fp8Trace | None = None
    error: str = ""
    optimizer: str = "adamw"

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
        out["device"] = None if self.device is None else self.device.to_dict()
        out["fp8_trace"] = None if self.fp8_trace is None else self.fp8_trace.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunRecord:
        """Inverse of `to_dict`, validated (extra keys are ignored, so older readers keep
        working; ``null`` floats, as strict JSON stores NaN, read back as NaN).

        Raises:
            ValueError: a missing or mistyped field, naming it.
        """
        if not isinstance(data, Mapping):
            raise ValueError(f"a run record must be a JSON object, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in names}
        for key in ("workload", "policy", "fingerprint"):
            if not isinstance(values.get(key), str):
                raise ValueError(f"field {key!r} must be a string, got {values.get(key)!r}")
        for key in ("seed", "steps"):
            v = values.get(key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"field {key!r} must be an int >= 0, got {v!r}")
        for key in ("size", "status", "metric_name", "error", "optimizer"):
            if key in values and not isinstance(values[key], str):
                raise ValueError(f"field {key!r} must be a string, got {values[key]!r}")
        for key in ("schedule_steps", "nonfinite_steps", "skipped_steps"):
            v = values.get(key, 0)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"field {key!r} must be an int >= 0, got {v!r}")
        for key in _FLOAT_FIELDS:
            if key in values:
                values[key] = _float(key, values[key])
        for key in _FLOAT_MAPPINGS:
            if key in values:
                values[key] = {
                    str(k): _float(f"{key}.{k}", v) for k, v in _mapping(key, values[key]).items()
                }
        for key in ("bytes", "predicted_bytes"):
            if key in values:
                raw = _mapping(key, values[key])
                if not all(isinstance(v, int) and not isinstance(v, bool) for v in raw.values()):
                    raise ValueError(f"field {key!r} must map components to integer bytes")
                values[key] = dict(raw)
        for key in ("loss_curve", "eval_curve", "loss_scale_trace"):
            if key in values:
                values[key] = _curve(key, values[key])
        for key in ("policy_fields", "effective"):
            if key in values:
                values[key] = dict(_mapping(key, values[key]))
        if values.get("device") is not None:
            values["device"] = DeviceFacts.from_dict(values["device"])
        if values.get("fp8_trace") is not None:
            values["fp8_trace"] = Fp8Trace.from_dict(values["fp8_trace"])
        if "doctor" in values:
            doctor = values["doctor"]
            if not isinstance(doctor, list) or not all(isinstance(f, Mapping) for f in doctor):
                raise ValueError("field 'doctor' must be a list of findings (objects)")
        try:
            return cls(**values)
        except TypeError as exc:  # a required field missing
            raise ValueError(str(exc).replace("__init__() ", "")) from None


_FLOAT_FIELDS = ("final_train_loss", "heldout_loss", "metric", "wall_time_s")
_FLOAT_MAPPINGS = ("throughput", "frozen_fraction", "probes")


def _float(key: str, value: Any) -> float:
    if value is None:
        return math.nan
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"field {key!r} must be a number or null, got {value!r}")
    return float(value)


def _mapping(key: str, value: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ValueError(f"field {key!r} must be an object, got {value!r}")
    return value


def _curve(key: str, value: Any) -> list[list[float]]:
    if not isinstance(value, list):
        raise ValueError(f"field {key!r} must be a list of [step, value] pairs, got {value!r}")
    out = []
    for item in value:
        if not (isinstance(item, list | tuple) and len(item) == 2):
            raise ValueError(f"field {key!r} must be a list of [step, value] pairs, got {item!r}")
        out.append([_float(key, item[0]), _float(key, item[1])])
    return out


def strict_json(value: Any) -> Any:
    """`value` with every non-finite float replaced by None (strict JSON has no NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [strict_json(v) for v in value]
    return value


def record_path(out_dir: Path, policy: str, seed: int) -> Path:
    """Where the record of `policy` with `seed` lives."""
    return out_dir / "runs" / f"{policy}-seed{seed}.json"


def _shared_mode() -> int:
    """The mode an ordinary new file gets here (0o666 less the umask)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` atomically.

    A temporary file in the same folder is flushed to disk, given the mode an
    ordinary new file gets (not mkstemp's 0600), then renamed over `path`: a crash
    leaves the old file or the new one, never half of one.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, _shared_mode())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text_atomic(path: Path, text: str) -> None:
    """Write `text` (UTF-8) to `path` atomically (`write_bytes_atomic`)."""
    write_bytes_atomic(path, text.encode("utf-8"))


def write_json_atomic(path: Path, data: Any) -> None:
    """Write strict JSON (non-finite floats as null) to `path` atomically
    (`write_bytes_atomic`)."""
    text = json.dumps(strict_json(data), indent=1, allow_nan=False) + "\n"
    write_bytes_atomic(path, text.encode("utf-8"))


def load_records(out_dir: Path) -> tuple[list[RunRecord], list[str], list[str]]:
    """The valid run records in `out_dir/runs`, a line for each file skipped, and a
    note for each record kept without its fp8 trace.

    A file is skipped when it is not valid JSON, is not a valid record, or names
    a policy and seed other than its file name says (a stray or edited file). A
    record whose only fault is its `fp8_trace` is kept without it: nothing is judged
    on the trace, so its losses still count (the note says which field was bad).
    """
    records: list[RunRecord] = []
    skipped: list[str] = []
    notes: list[str] = []
    for path in sorted((out_dir / "runs").glob("*.json")):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            try:
                record = RunRecord.from_dict(data)
            except ValueError as exc:
                if not (isinstance(data, dict) and str(exc).startswith("field 'fp8_trace")):
                    raise
                record = RunRecord.from_dict({**data, "fp8_trace": None})
                notes.append(f"{path}: its fp8 trace was left out ({exc}); the run is kept")
        except json.JSONDecodeError as exc:
            skipped.append(f"{path}: not valid JSON ({exc.msg}, line {exc.lineno})")
            continue
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            skipped.append(f"{path}: {reason}")
            continue
        if record_path(out_dir, record.policy, record.seed).name != path.name:
            skipped.append(
                f"{path}: holds {record.policy} seed {record.seed}, which belongs in "
                f"{record_path(out_dir, record.policy, record.seed).name}"
            )
            continue
        records.append(record)
    return records, skipped, notes


def read_records(out_dir: Path) -> list[RunRecord]:
    """Every run record in `out_dir/runs`, sorted by file name.

    Raises:
        ValueError: a record that is not valid, naming the file.
    """
    records, skipped, _ = load_records(out_dir)
    if skipped:
        raise ValueError(f"run record {skipped[0]}")
    return records
