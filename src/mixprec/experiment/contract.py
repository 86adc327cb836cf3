"""The experiment contract: what is compared, for how long, and the gates that decide.

A contract is plain data (from command-line flags or a YAML file) so that a
decision can be re-judged from stored records without re-running anything.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mixprec.experiment.gates import Gates
from mixprec.experiment.hardware import DEVICE_TYPES
from mixprec.experiment.optimizer import (
    DEFAULT_OPTIMIZER,
    check_optimizer,
    optimizer_label,
    parse_optimizer_args,
)
from mixprec.policy import preset
from mixprec.workloads.settings import TrainSettings

__all__ = [
    "DECISION_KEYS",
    "DEFAULT_CANDIDATES",
    "MAX_SEEDS",
    "OBJECTIVES",
    "TRAIN_KEYS",
    "Contract",
    "candidates_from",
    "canonical_policy",
    "format_bytes",
    "parse_bytes",
    "split_train_keys",
]

#: Bumped when runs record something new that the decision reads (version 2: held-out
#: evaluations at the start of each compared step's last fifth; 3: at step 0 too), so
#: that older records are re-run instead of reused.
RECORD_VERSION = 3

#: The candidates `mixprec compare` tries against the fp32 baseline by default.
DEFAULT_CANDIDATES: tuple[str, ...] = (
    "amp_bf16",
    "bf16_master",
    "bf16_lean",
    "bf16_pure",
    "amp_fp16",
    "fp16_unscaled",
)

#: What the recommendation optimizes among the policies that pass the gates: the least
#: measured memory, the shortest step time, or (default) the best product of the two
#: relative to the baseline.
OBJECTIVES: tuple[str, ...] = ("balanced", "memory", "speed")

#: Contract keys that only decide (what to recommend, under which limits, for which
#: hardware): they never change what a run computes, so they stay out of run
#: fingerprints and changing them re-judges stored runs without training again.
DECISION_KEYS: tuple[str, ...] = (
    "objective",
    "memory_budget",
    "max_slowdown",
    "target_device",
    "baseline_for_fp8",
)


@dataclass(frozen=True, kw_only=True)
class Contract:
    """One precision experiment.

    Attributes:
        workload: a built-in workload name (or ``module:function`` from the
            command line; never from a file).
        size: the workload's size preset; None: ``compare`` for shakespeare (a GPT
            sized so every default policy fits a few minutes on a 2-core CPU), the
            workload's own default otherwise (user workloads get no ``size``).
        baseline: the reference policy (a preset name or alias).
        candidates: policies judged against the baseline.
        seeds: how many seeds (0..seeds-1) every policy runs; each seed fixes
            initial weights and data order, the same for every policy.
        max_seeds: the seeds at which a candidate is called eligible, in one look:
            `compare` adds one seed at a time to the candidates neither rejected nor
            eligible (and the baseline) up to this; earlier looks can only reject
            (`verdicts.gap_verdict`). None: ``max(seeds, 5)``.
        allow: doctor rule ids acknowledged for this experiment: an error of
            an update-path rule (`mixprec.doctor.UPDATE_PATH_RULES`) with one of
            these ids no longer rejects a candidate; the report shows it.
        train: overrides of the workload's training settings, by `TrainSettings`
            field name (``steps``, ``batch_size``, ``lr``, ``min_lr``,
            ``warmup_steps``, ``weight_decay``, ``grad_clip_norm``, ``betas``); a
            field left out (or None) keeps the workload's value, and an override
            wins (`TrainSettings.with_overrides`). In the dict form (YAML, JSON,
            `from_dict`, `mixprec.compare(**kw)`) these are top-level keys
            (``steps: 500``).
        eval_every: steps between held-out evaluations for the curves (the final
            evaluation always runs).
        probe_every: steps between the doctor's runtime probe samples.
        step_caps: policy -> the step at which its run stops (the learning-rate
            schedule stays that of the full run, so it is compared with the baseline
            at the same step). None: automatic, fp16-compute candidates stop at a
            fifth of the steps on devices whose fp16 matmuls are not accelerated
            (emulated fp16 is tens of times slower there); ``{}``: no caps.
        gates: the quality gates.
        objective: what the recommendation optimizes among the baseline and the
            candidates that pass every gate: ``memory`` (least measured memory),
            ``speed`` (shortest step time) or ``balanced`` (default: the least
            product of memory and step time, each relative to the baseline). See
            docs/compare.md.
        memory_budget: the most measured training memory (bytes) a recommended
            policy may use; a candidate over it is rejected, naming by how much, and
            so is the baseline as a recommendation. From files and flags also a
            size with a unit: ``"6 GiB"``, ``"512 MiB"``, ``"8 GB"``. None: no budget.
        max_slowdown: the largest step time relative to the baseline's a recommended
            policy may take (``1.5``: at most 1.5 x the baseline's step time); a
            candidate over it is rejected with the figures. Judged only on timings
            measured on the target. None: no limit.
        target_device: the hardware the policy will train on: a device class
            (``cuda``, ``cpu``, ``mps``, ``xpu``; ``cuda:0`` means ``cuda``), ``gpu``
            (any accelerator), or whole words of a device name (``H100``).
        optimizer: the optimizer every run trains with, by name (``adamw``, ``adam``,
            ``sgd``, ``lion``: `mixprec.experiment.optimizer.OPTIMIZERS`); runs of
            different optimizers are different runs. See docs/compare.md.
        optimizer_args: its keyword arguments (a mapping, or ``k=v[,k=v]``);
            ``lr``, ``weight_decay`` and ``betas`` given here are training settings
            and are moved to `train`. Checked against the class before any run.
        baseline_for_fp8: the 16-bit candidate the FP8 candidates (policies with
            `fp8` settings) must also match within `max_rel_loss_gap`; None: the
            best eligible 16-bit candidate under the objective. See
            `mixprec.experiment.fp8_gate`.
            When the runs were measured elsewhere, nothing is promoted: the verdict
            is pending a run on the target. None: the hardware the runs used.
    """

    workload: str = "shakespeare"
    size: str | None = None
    baseline: str = "fp32"
    candidates: tuple[str, ...] = DEFAULT_CANDIDATES
    seeds: int = 2
    max_seeds: int | None = None
    allow: tuple[str, ...] = ()
    train: Mapping[str, object] = field(default_factory=dict)
    eval_every: int = 100
    probe_every: int = 25
    step_caps: Mapping[str, int] | None = None
    gates: Gates = field(default_factory=Gates)
    objective: str = "balanced"
    memory_budget: int | None = None
    max_slowdown: float | None = None
    target_device: str | None = None
    baseline_for_fp8: str | None = None
    optimizer: str = DEFAULT_OPTIMIZER
    optimizer_args: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("workload", "baseline"):
            v = getattr(self, name)
            if not isinstance(v, str) or not v.strip():
                raise ValueError(f"{name} must be a non-empty string, got {v!r}")
        if self.size is not None and not isinstance(self.size, str):
            raise ValueError(f"size must be a string (e.g. tiny) or null, got {self.size!r}")
        if isinstance(self.candidates, str) or not isinstance(self.candidates, tuple):
            object.__setattr__(self, "candidates", tuple(_split(self.candidates)))
        # Aliases name presets (bf16-mixed is amp_bf16): judge and store presets only.
        object.__setattr__(self, "baseline", canonical_policy(self.baseline))
        object.__setattr__(self, "candidates", tuple(canonical_policy(c) for c in self.candidates))
        if not self.candidates:
            raise ValueError("candidates is empty: name at least one policy to judge")
        if len(set(self.candidates)) != len(self.candidates):
            raise ValueError(
                f"candidates repeat a policy (aliases resolved): {list(self.candidates)}"
            )
        if self.baseline in self.candidates:
            raise ValueError(f"the baseline {self.baseline!r} is also listed as a candidate")
        resolved = {n: preset(n).name for n in (self.baseline, *self.candidates)}
        if "auto" in resolved and resolved["auto"] in resolved:
            raise ValueError(
                f"'auto' resolves to {resolved['auto']!r} on this device, which is also listed; "
                "list it once"
            )
        object.__setattr__(self, "train", TrainSettings.check_overrides(self.train))
        name, args, train = check_optimizer(
            self.optimizer, parse_optimizer_args(self.optimizer_args), self.train
        )
        object.__setattr__(self, "optimizer", name)
        object.__setattr__(self, "optimizer_args", args)
        object.__setattr__(self, "train", train)
        if not (
            isinstance(self.seeds, int) and not isinstance(self.seeds, bool) and self.seeds >= 1
        ):
            raise ValueError(f"seeds must be an int >= 1, got {self.seeds!r}")
        if self.max_seeds is not None and not (
            isinstance(self.max_seeds, int)
            and not isinstance(self.max_seeds, bool)
            and self.max_seeds >= self.seeds
        ):
            raise ValueError(
                f"max_seeds must be an int >= seeds ({self.seeds}) or None, got {self.max_seeds!r}"
            )
        if isinstance(self.allow, str) or not isinstance(self.allow, tuple):
            object.__setattr__(self, "allow", tuple(_split(self.allow)))
        from mixprec.doctor.findings import UPDATE_PATH_RULES

        unknown_rules = [r for r in self.allow if r not in UPDATE_PATH_RULES]
        if unknown_rules:
            raise ValueError(
                f"allow names {unknown_rules}, which are not update-path rules (only those "
                f"reject a candidate); valid: {list(UPDATE_PATH_RULES)}"
            )
        if self.max_seeds is not None and self.max_seeds > MAX_SEEDS:
            raise ValueError(f"max_seeds must be at most {MAX_SEEDS}, got {self.max_seeds}")
        if self.step_caps is not None:
            if not isinstance(self.step_caps, Mapping):
                raise ValueError(
                    f"step_caps must be a mapping policy -> steps, got {self.step_caps!r}"
                )
            caps = {canonical_policy(str(name)): cap for name, cap in self.step_caps.items()}
            object.__setattr__(self, "step_caps", caps)
            for name, cap in caps.items():
                if name not in self.candidates:
                    raise ValueError(
                        f"step_caps names {name!r}, which is not a candidate: "
                        f"{list(self.candidates)}"
                    )
                if not (isinstance(cap, int) and not isinstance(cap, bool) and cap >= 1):
                    raise ValueError(f"step cap of {name!r} must be an int >= 1, got {cap!r}")
            object.__setattr__(self, "step_caps", dict(self.step_caps))
        for name in ("eval_every", "probe_every"):
            v = getattr(self, name)
            if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        self._check_decision_keys()

    def _check_decision_keys(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(
                f"objective {self.objective!r} is not one of {', '.join(OBJECTIVES)}: "
                "memory (least memory), speed (shortest step time) or balanced (their product)"
            )
        if self.memory_budget is not None:
            object.__setattr__(self, "memory_budget", parse_bytes(self.memory_budget))
        if self.max_slowdown is not None:
            value = _from_text(self.max_slowdown)
            if not (isinstance(value, int | float) and not isinstance(value, bool)) or not (
                0 < value < math.inf
            ):
                raise ValueError(
                    f"max_slowdown {self.max_slowdown!r} is not a number > 0: give the largest "
                    "step time relative to the baseline's, e.g. 1.5"
                )
            object.__setattr__(self, "max_slowdown", float(value))
        if self.target_device is not None:
            named = isinstance(self.target_device, str) and any(
                ch.isalnum() for ch in self.target_device
            )
            if named and len(self.target_device) > _MAX_TARGET_CHARS:
                raise ValueError(
                    f"target_device is {len(self.target_device)} characters long: give a device "
                    f"class or words of a device name (at most {_MAX_TARGET_CHARS} characters)"
                )
            kind, colon, index = str(self.target_device).strip().partition(":")
            if named and colon and kind.lower() in DEVICE_TYPES and not index.isdigit():
                raise ValueError(
                    f"target_device {self.target_device!r}: a device index is a number "
                    f"({kind}:0), or give the device class alone ({kind})"
                )
            if not named:
                what = "is empty" if isinstance(self.target_device, str) else "is not a device"
                raise ValueError(
                    f"target_device {self.target_device!r} {what}: give a device class "
                    "(cpu, cuda, mps, xpu, gpu) or words of a device name (e.g. H100), or "
                    "leave it out"
                )
            object.__setattr__(self, "target_device", self.target_device.strip())
        if self.baseline_for_fp8 is not None:
            self._check_baseline_for_fp8()

    def _check_baseline_for_fp8(self) -> None:
        name = self.baseline_for_fp8
        if not isinstance(name, str) or not name.strip():
            raise ValueError(
                f"baseline_for_fp8 {name!r} is not a policy name: name a 16-bit candidate "
                "(e.g. amp_bf16), or leave it out for the best eligible one"
            )
        try:
            name = canonical_policy(name)
        except ValueError as exc:
            raise ValueError(f"baseline_for_fp8 {name!r}: {exc}") from None
        sixteen = [c for c in self.candidates if preset(c).fp8 is None]
        if name not in sixteen:
            choose = f"name one of {sixteen}, or " if sixteen else ""
            raise ValueError(
                f"baseline_for_fp8 {name!r} is not a 16-bit candidate of this contract: "
                f"{choose}add it to the candidates"
            )
        object.__setattr__(self, "baseline_for_fp8", name)

    @property
    def seed_limit(self) -> int:
        """The effective `max_seeds`."""
        return max(self.seeds, 5) if self.max_seeds is None else self.max_seeds

    @property
    def policies(self) -> tuple[str, ...]:
        """Baseline first, then the candidates."""
        return (self.baseline, *self.candidates)

    @property
    def optimizer_label(self) -> str:
        """The optimizer and its own arguments, as reports name it (``sgd (momentum=0.9)``)."""
        return optimizer_label(self.optimizer, self.optimizer_args)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (for results.json and re-judging): the `train` overrides flat."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name == "train":
                out.update(_train_dict(self.train))
            elif f.name == "gates":
                out["gates"] = dataclasses.asdict(self.gates)
            elif f.name in DECISION_KEYS:
                # Written only when set, so that contracts written before these keys
                # existed read and write back unchanged.
                value = getattr(self, f.name)
                if value is not None and value != f.default:
                    out[f.name] = value
            elif f.name in ("optimizer", "optimizer_args"):
                # Written only for another optimizer than AdamW (or AdamW with arguments):
                # contracts and run fingerprints of before keep their hashes.
                if self.optimizer != DEFAULT_OPTIMIZER or self.optimizer_args:
                    out["optimizer"] = self.optimizer
                    out["optimizer_args"] = {
                        k: list(v) if isinstance(v, tuple) else v
                        for k, v in sorted(self.optimizer_args.items())
                    }
            else:
                out[f.name] = getattr(self, f.name)
        out["candidates"] = list(self.candidates)
        out["allow"] = list(self.allow)
        out["step_caps"] = None if self.step_caps is None else dict(self.step_caps)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Contract:
        """Build from plain data (a YAML mapping); unknown keys raise, naming the valid ones."""
        if isinstance(data, Mapping) and "noise_multiplier" in data:
            raise ValueError(
                "key 'noise_multiplier' was replaced by gates.confidence (a paired t-interval "
                "over seeds; see docs/compare.md): remove it"
            )
        values = split_train_keys(
            data,
            fields=[f.name for f in dataclasses.fields(cls)],
            int_fields=_INT_FIELDS,
            what="contract",
        )
        if "gates" in values:
            raw = values["gates"]
            if not isinstance(raw, Mapping):
                raise ValueError(f"gates must be a mapping, got {raw!r}")
            gate_keys = {f.name for f in dataclasses.fields(Gates)}
            if "noise_multiplier" in raw:
                raise ValueError(
                    "gate key 'noise_multiplier' was replaced by 'confidence' (a paired "
                    "t-interval over seeds; see docs/compare.md): remove it"
                )
            bad = sorted(str(k) for k in set(raw) - gate_keys)
            if bad:
                raise ValueError(f"unknown gate keys {bad}; valid keys: {sorted(gate_keys)}")
            gate_values: dict[str, Any] = {str(k): _from_text(v) for k, v in raw.items()}
            values["gates"] = Gates(**gate_values)
        if "candidates" in values:
            values["candidates"] = tuple(_split(values["candidates"]))
        return cls(**values)

    def run_fingerprint(self, policy_name: str, seed: int, run_steps: int | None = None) -> str:
        """A hash of everything that determines one run's result (for resuming)."""
        settings = self.to_dict()
        for key in ("baseline", "candidates", "seeds", "max_seeds", "allow", "gates", "step_caps"):
            settings.pop(key)
        for key in DECISION_KEYS:
            settings.pop(key, None)
        pol = preset(policy_name).to_dict()
        pol.pop("note", None)
        # Policy fields added since (fp8, grad_accum_dtype, release_gradients) are hashed
        # only when set, so the records of earlier versions keep their fingerprints and
        # are reused, not retrained.
        for key in _POLICY_KEYS_HASHED_WHEN_SET:
            if pol.get(key) in (None, "none", False):
                pol.pop(key, None)
        blob = json.dumps(
            {
                "settings": settings,
                "policy": pol,
                "seed": seed,
                "run_steps": run_steps,
                "record_version": RECORD_VERSION,
            },
            sort_keys=True,
        )
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def digest(self) -> str:
        """A hash of the whole contract, gates and decision keys included: two results
        judged under the same digest were judged by the same rules (results.json
        ``contract_digest``). Run fingerprints leave the judging keys out."""
        blob = json.dumps(self.to_dict(), sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


#: `Policy.to_dict` keys newer than record version 3, left out of run fingerprints
#: while None (see `Contract.run_fingerprint`).
_POLICY_KEYS_HASHED_WHEN_SET = ("fp8", "grad_accum_dtype", "release_gradients")

#: Most seeds a contract may ask for (a guard against typos: each seed is a run).
MAX_SEEDS = 100

#: Longest `target_device` accepted (device names are short; a long string is a mistake).
_MAX_TARGET_CHARS = 200


def canonical_policy(name: str) -> str:
    """The preset name of `name` (an alias resolved); ValueError naming valid ones."""
    from mixprec.policy import ALIASES

    if not isinstance(name, str):
        raise ValueError(f"policy names must be strings, got {name!r}")
    preset(name)  # raises ValueError naming valid presets
    return ALIASES.get(name, name)


_UNITS = {
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?(?:e[0-9]+)?)\s*([a-z]*)\s*", re.IGNORECASE)


def parse_bytes(value: object) -> int:
    """A memory size in bytes: an int, or a string with a unit (``"6 GiB"``,
    ``"512MiB"``, ``"8 GB"``; KiB/MiB/GiB/TiB are powers of 1024, kB/MB/GB/TB of 1000).

    Raises:
        ValueError: not a positive size, naming the value and the accepted forms.
    """
    fix = "give bytes (e.g. 6442450944) or a number with a unit: 6 GiB, 512 MiB, 8 GB"
    number: float | None = None
    unit = ""
    if isinstance(value, int | float) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str):
        match = _SIZE.fullmatch(value)
        unit = match.group(2).lower() if match else ""
        if match and (unit or "b") in _UNITS:
            number = float(match.group(1)) * _UNITS[unit or "b"]
    if number is None or not (math.isfinite(number) and number >= 1):
        raise ValueError(f"memory_budget {value!r} is not a size: {fix}")
    if unit in ("", "b") and not number.is_integer():  # found by review: 1.5 meant GiB
        raise ValueError(
            f"memory_budget {value!r} is a fraction of a byte count: add the unit you mean "
            f"({value} GiB?), or give whole bytes"
        )
    return round(number)


def format_bytes(n: float) -> str:
    """``7.71 MiB``, ``6.00 GiB``: bytes in the largest binary unit that keeps 1 or more."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _from_text(value: object) -> object:
    """A YAML 1.1 reader leaves ``1e-3`` (no dot) a string: read numeric strings as floats."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


#: Whole-number fields of a contract: ``1e2`` is read as 100 (see `_whole`).
_INT_FIELDS = ("seeds", "max_seeds", "eval_every", "probe_every")

#: Names of the `TrainSettings` fields. In the dict form of a contract or a training
#: recipe they are top-level keys (``steps: 500``), collected into its `train` overrides.
TRAIN_KEYS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(TrainSettings))


def split_train_keys(
    data: Mapping[str, Any], *, fields: list[str], int_fields: tuple[str, ...], what: str
) -> dict[str, Any]:
    """The dict form shared by a `Contract` and a training `Recipe`, as keyword arguments.

    Top-level keys are the object's own `fields` (but ``train``) and the
    `TrainSettings` fields, which are collected into ``train``. Whole numbers that
    YAML 1.1 reads as strings or floats (``1e2``) become ints, in the training
    fields and in `int_fields`.

    Raises:
        ValueError: `data` is not a mapping, or holds a key that is neither, naming
            the valid keys.
    """
    if not isinstance(data, Mapping):
        raise ValueError(f"a {what} must be a mapping, got {type(data).__name__}")
    valid = (set(fields) - {"train"}) | set(TRAIN_KEYS)
    unknown = sorted(str(k) for k in set(data) - valid)
    if unknown:
        raise ValueError(f"unknown {what} keys {unknown}; valid keys: {sorted(valid)}")
    values = {str(k): v for k, v in data.items() if k not in TRAIN_KEYS}
    values["train"] = {k: _whole(v) for k, v in data.items() if k in TRAIN_KEYS}
    for key in int_fields:
        if key in values:
            values[key] = _whole(values[key])
    return values


#: The training keys every contract of RECORD_VERSION 3 holds in its dict form, null
#: when not overridden. They are written the same way so that fingerprints of stored
#: runs still match; a field added to `TrainSettings` since is written only when set.
_V3_TRAIN_KEYS = (
    "steps",
    "batch_size",
    "lr",
    "min_lr",
    "warmup_steps",
    "weight_decay",
    "grad_clip_norm",
)


def _train_dict(train: Mapping[str, object]) -> dict[str, object]:
    """The dict form of `train` overrides, in `TrainSettings` field order."""
    out: dict[str, object] = {}
    for f in dataclasses.fields(TrainSettings):
        value = train.get(f.name)
        if value is not None or f.name in _V3_TRAIN_KEYS:
            out[f.name] = list(value) if isinstance(value, tuple) else value
    return out


def _whole(value: object) -> object:
    """``1e2`` (a string to YAML 1.1, a float to JSON) as the int 100; others unchanged
    (`TrainSettings` turns a whole ``lr: 1.0`` back into the float it is)."""
    value = _from_text(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def candidates_from(policies: object, baseline: object = "fp32") -> list[str]:
    """The candidates of a policy list that may also name the baseline (``--policies
    fp32,amp_bf16``): the baseline is dropped.

    Raises:
        ValueError: nothing but the baseline is named.
    """
    names = [n for n in _split(policies) if n and n != baseline]
    if not names:
        raise ValueError(f"policies {policies!r} name no candidate besides the baseline")
    return names


def _split(value: object) -> list[str]:
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    if isinstance(value, list | tuple):
        return [str(v).strip() for v in value]
    raise ValueError(f"expected a list of policy names or a comma-separated string, got {value!r}")
