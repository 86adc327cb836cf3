"""Findings: what the doctor reports, and the registry of rule ids.

A `Finding` is plain, frozen data: a stable rule id, a severity, where the
problem sits (a file and key path, or a module/parameter name), a message, the
evidence (JSON-ready values that triggered it) and the fix. Rule ids are
contract: scripts filter on them, so they never change meaning.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, cast

__all__ = [
    "INPUT_RULES",
    "RULES",
    "RUNTIME_RULES",
    "SEVERITIES",
    "STATIC_RULES",
    "UPDATE_PATH_RULES",
    "Finding",
    "RuleInfo",
    "Severity",
    "count_by_severity",
    "has_errors",
    "sort_findings",
]

Severity = Literal["error", "warning", "info"]

#: Severities, most serious first.
SEVERITIES: tuple[Severity, ...] = ("error", "warning", "info")


@dataclass(frozen=True, kw_only=True)
class RuleInfo:
    """One rule the doctor knows.

    Attributes:
        id: the stable rule id (contract).
        kind: ``"static"`` (judged from a config or live objects before a run),
            ``"runtime"`` (measured by `Probe` during a run), or ``"input"`` (a
            config file the doctor could not read or judge).
        summary: one line on what the rule catches.
    """

    id: str
    kind: Literal["static", "runtime", "input"]
    summary: str


_RULE_LIST: tuple[RuleInfo, ...] = (
    RuleInfo(
        id="optimizer-state-16bit",
        kind="static",
        summary="Adam-family optimizer without a master over 16-bit parameters",
    ),
    RuleInfo(
        id="fp16-without-loss-scaling",
        kind="static",
        summary="fp16 compute without loss scaling: small gradients underflow to zero",
    ),
    RuleInfo(
        id="loss-scaling-unneeded",
        kind="static",
        summary="a loss scaler with bf16/fp32 compute, whose range needs none",
    ),
    RuleInfo(
        id="reduce-dtype-16bit",
        kind="static",
        summary="gradients reduced across ranks in bf16/fp16",
    ),
    RuleInfo(
        id="fsdp-without-mixed-precision",
        kind="static",
        summary="FSDP2 groups all-gathering fp32 parameters under a 16-bit compute policy",
    ),
    RuleInfo(
        id="master-without-16bit-params",
        kind="static",
        summary="a master representation requested for fp32 parameters",
    ),
    RuleInfo(
        id="format-not-accelerated",
        kind="static",
        summary="the compute format (16-bit or fp8) is emulated or unsupported on the device",
    ),
    RuleInfo(
        id="norm-in-16bit",
        kind="static",
        summary="norm layers or the loss in 16-bit without an fp32 island",
    ),
    RuleInfo(
        id="fp8-without-scaling",
        kind="static",
        summary="fp8 values without a scaling recipe",
    ),
    RuleInfo(
        id="clip-before-unscale",
        kind="runtime",
        summary="gradients clipped while they still carry the loss scale",
    ),
    RuleInfo(
        id="loss-scale-collapse",
        kind="runtime",
        summary="the dynamic loss scale keeps falling, with frequent skipped steps",
    ),
    RuleInfo(
        id="gradient-underflow",
        kind="runtime",
        summary="gradient elements lost (or that would be lost) below fp16's range",
    ),
    RuleInfo(
        id="vanishing-updates",
        kind="runtime",
        summary="non-zero updates that did not change 16-bit stored parameters",
    ),
    RuleInfo(
        id="nonfinite-source",
        kind="runtime",
        summary="the first module whose forward output turned inf/NaN",
    ),
    RuleInfo(
        id="grad-accum-16bit",
        kind="runtime",
        summary="gradients of 16-bit parameters summed in 16 bits over a step's micro-batches",
    ),
    RuleInfo(
        id="fp8-saturation",
        kind="runtime",
        summary="fp8 casts that clip at the format's max (measured, or under a delayed-scaling "
        "what-if)",
    ),
    RuleInfo(
        id="fp8-underflow",
        kind="runtime",
        summary="fp8 casts that flush non-zero values to zero",
    ),
    RuleInfo(
        id="config-unreadable",
        kind="input",
        summary="a config file that could not be read, or a value of an unexpected type",
    ),
)

#: Every rule, by id.
RULES: dict[str, RuleInfo] = {r.id: r for r in _RULE_LIST}

#: Ids of the rules judged before a run, in documentation order.
STATIC_RULES: tuple[str, ...] = tuple(r.id for r in _RULE_LIST if r.kind == "static")

#: Ids of the rules measured during a run, in documentation order.
RUNTIME_RULES: tuple[str, ...] = tuple(r.id for r in _RULE_LIST if r.kind == "runtime")

#: Ids of the rules about the input itself (a file that could not be read or judged).
INPUT_RULES: tuple[str, ...] = tuple(r.id for r in _RULE_LIST if r.kind == "input")

#: Rules about how updates reach the weights, or the state that computes them. At
#: error severity they mean the run's weights do not follow its gradients (lost
#: updates, a collapsing scale, flushed gradients, moments that cannot hold the
#: update), whatever its loss says: `mixprec compare` rejects such a candidate
#: unless the contract acknowledges the rule (``allow``).
UPDATE_PATH_RULES: tuple[str, ...] = (
    "optimizer-state-16bit",
    "vanishing-updates",
    "loss-scale-collapse",
    "gradient-underflow",
)


@dataclass(frozen=True, kw_only=True)
class Finding:
    """One problem the doctor found, with its evidence and fix.

    Attributes:
        rule: the rule id (one of `RULES`).
        severity: ``"error"`` (the run will silently degrade or fail),
            ``"warning"`` (likely to hurt; check), or ``"info"`` (worth knowing).
        where: the file and key path (``"run.yaml:12 optimizer._target_"``), or a
            module/parameter name (``"model.blocks.0.norm"``).
        message: what is wrong and why it matters, in a sentence or two.
        evidence: the values that triggered the finding (JSON-ready).
        fix: what to change.
    """

    rule: str
    severity: Severity
    where: str
    message: str
    evidence: dict[str, Any] = field(default_factory=dict)
    fix: str

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"unknown rule {self.rule!r}; valid: {', '.join(RULES)}")
        if self.severity not in SEVERITIES:
            raise ValueError(f"unknown severity {self.severity!r}; valid: {', '.join(SEVERITIES)}")
        try:
            json.dumps(self.evidence, allow_nan=True)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"evidence of {self.rule!r} is not JSON-ready: {exc}") from exc

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field."""
        return {
            "rule": self.rule,
            "severity": self.severity,
            "where": self.where,
            "message": self.message,
            "evidence": dict(self.evidence),
            "fix": self.fix,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Finding:
        """Inverse of `to_dict`."""
        return cls(
            rule=str(data["rule"]),
            severity=cast(Severity, str(data["severity"])),
            where=str(data["where"]),
            message=str(data["message"]),
            evidence=dict(data.get("evidence", {})),
            fix=str(data["fix"]),
        )


def sort_findings(findings: Iterable[Finding]) -> list[Finding]:
    """Findings ordered by severity (errors first), then rule, then place."""
    order = {s: i for i, s in enumerate(SEVERITIES)}
    return sorted(findings, key=lambda f: (order[f.severity], f.rule, f.where))


def has_errors(findings: Iterable[Finding]) -> bool:
    """Whether any finding is an error (the CLI then exits with code 1)."""
    return any(f.severity == "error" for f in findings)


def count_by_severity(findings: Iterable[Finding]) -> dict[str, int]:
    """``{"error": n, "warning": n, "info": n}``."""
    counts: dict[str, int] = dict.fromkeys(SEVERITIES, 0)
    for f in findings:
        counts[f.severity] += 1
    return counts
