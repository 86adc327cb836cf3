"""The doctor: finds precision problems before and during a run, with evidence and a fix.

Before a run, on live objects or on config files::

    findings = mixprec.doctor.check(policy="bf16_pure", model=model, optimizer=opt)
    findings = mixprec.doctor.check_file("recipe.yaml")   # mixprec or NeMo AutoModel YAML

During a run, with runtime probes::

    probe = mixprec.doctor.Probe(model=model)
    with probe.watching(prec):
        ...  # the training loop
    probe.findings()

Every `Finding` has a stable rule id (`RULES`), a severity, where, a message,
JSON-ready evidence and a fix. Static rules (`rules`, over `facts`) sit here;
what reads a setup into facts is in `frontends`, what watches a run in `runtime`.
See docs/doctor.md.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mixprec.doctor.facts import GroupFacts as GroupFacts
    from mixprec.doctor.facts import OptimizerFacts as OptimizerFacts
    from mixprec.doctor.facts import TrainingFacts as TrainingFacts
    from mixprec.doctor.findings import INPUT_RULES as INPUT_RULES
    from mixprec.doctor.findings import RULES as RULES
    from mixprec.doctor.findings import RUNTIME_RULES as RUNTIME_RULES
    from mixprec.doctor.findings import SEVERITIES as SEVERITIES
    from mixprec.doctor.findings import STATIC_RULES as STATIC_RULES
    from mixprec.doctor.findings import UPDATE_PATH_RULES as UPDATE_PATH_RULES
    from mixprec.doctor.findings import Finding as Finding
    from mixprec.doctor.findings import RuleInfo as RuleInfo
    from mixprec.doctor.findings import Severity as Severity
    from mixprec.doctor.findings import has_errors as has_errors
    from mixprec.doctor.findings import sort_findings as sort_findings
    from mixprec.doctor.frontends import check as check
    from mixprec.doctor.frontends import check_file as check_file
    from mixprec.doctor.frontends import detect_format as detect_format
    from mixprec.doctor.frontends import facts_from_objects as facts_from_objects
    from mixprec.doctor.frontends import load_config as load_config
    from mixprec.doctor.frontends import optimizer_facts as optimizer_facts
    from mixprec.doctor.rules import SHORT_RUN_STEPS as SHORT_RUN_STEPS
    from mixprec.doctor.rules import run_static_rules as run_static_rules
    from mixprec.doctor.runtime import DEFAULT_EVERY as DEFAULT_EVERY
    from mixprec.doctor.runtime import DEFAULT_OVERHEAD_BUDGET as DEFAULT_OVERHEAD_BUDGET
    from mixprec.doctor.runtime import GradientStats as GradientStats
    from mixprec.doctor.runtime import Probe as Probe
    from mixprec.doctor.runtime import ProbeCost as ProbeCost
    from mixprec.doctor.runtime import ProbeSample as ProbeSample
    from mixprec.doctor.runtime import ProbeThresholds as ProbeThresholds
    from mixprec.doctor.runtime import UpdateStats as UpdateStats
    from mixprec.doctor.runtime import ZeroBreakdown as ZeroBreakdown
    from mixprec.doctor.runtime import gradient_stats as gradient_stats
    from mixprec.doctor.runtime import update_stats as update_stats

#: Public name -> the module that defines it (the imports above are what type checkers
#: read; tests/test_public_api.py keeps both equal). Imported on first use (PEP 562):
#: static config checks (`check_file`) must not load torch, which the runtime probes need.
_EXPORTS = {
    "GroupFacts": "mixprec.doctor.facts",
    "OptimizerFacts": "mixprec.doctor.facts",
    "TrainingFacts": "mixprec.doctor.facts",
    "INPUT_RULES": "mixprec.doctor.findings",
    "RULES": "mixprec.doctor.findings",
    "RUNTIME_RULES": "mixprec.doctor.findings",
    "SEVERITIES": "mixprec.doctor.findings",
    "STATIC_RULES": "mixprec.doctor.findings",
    "UPDATE_PATH_RULES": "mixprec.doctor.findings",
    "Finding": "mixprec.doctor.findings",
    "RuleInfo": "mixprec.doctor.findings",
    "Severity": "mixprec.doctor.findings",
    "has_errors": "mixprec.doctor.findings",
    "sort_findings": "mixprec.doctor.findings",
    "check": "mixprec.doctor.frontends",
    "check_file": "mixprec.doctor.frontends",
    "detect_format": "mixprec.doctor.frontends",
    "facts_from_objects": "mixprec.doctor.frontends",
    "load_config": "mixprec.doctor.frontends",
    "optimizer_facts": "mixprec.doctor.frontends",
    "SHORT_RUN_STEPS": "mixprec.doctor.rules",
    "run_static_rules": "mixprec.doctor.rules",
    "DEFAULT_EVERY": "mixprec.doctor.runtime",
    "DEFAULT_OVERHEAD_BUDGET": "mixprec.doctor.runtime",
    "GradientStats": "mixprec.doctor.runtime",
    "Probe": "mixprec.doctor.runtime",
    "ProbeCost": "mixprec.doctor.runtime",
    "ProbeSample": "mixprec.doctor.runtime",
    "ProbeThresholds": "mixprec.doctor.runtime",
    "UpdateStats": "mixprec.doctor.runtime",
    "ZeroBreakdown": "mixprec.doctor.runtime",
    "gradient_stats": "mixprec.doctor.runtime",
    "update_stats": "mixprec.doctor.runtime",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'mixprec.doctor' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
