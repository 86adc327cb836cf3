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

from mixprec.doctor.facts import GroupFacts, OptimizerFacts, TrainingFacts
from mixprec.doctor.findings import (
    INPUT_RULES,
    RULES,
    RUNTIME_RULES,
    SEVERITIES,
    STATIC_RULES,
    UPDATE_PATH_RULES,
    Finding,
    RuleInfo,
    Severity,
    has_errors,
    sort_findings,
)
from mixprec.doctor.frontends import (
    check,
    check_file,
    detect_format,
    facts_from_objects,
    load_config,
    optimizer_facts,
)
from mixprec.doctor.rules import SHORT_RUN_STEPS, run_static_rules
from mixprec.doctor.runtime import (
    DEFAULT_EVERY,
    GradientStats,
    Probe,
    ProbeSample,
    ProbeThresholds,
    UpdateStats,
    gradient_stats,
    update_stats,
)

__all__ = [
    "DEFAULT_EVERY",
    "INPUT_RULES",
    "RULES",
    "RUNTIME_RULES",
    "SEVERITIES",
    "SHORT_RUN_STEPS",
    "STATIC_RULES",
    "UPDATE_PATH_RULES",
    "Finding",
    "GradientStats",
    "GroupFacts",
    "OptimizerFacts",
    "Probe",
    "ProbeSample",
    "ProbeThresholds",
    "RuleInfo",
    "Severity",
    "TrainingFacts",
    "UpdateStats",
    "check",
    "check_file",
    "detect_format",
    "facts_from_objects",
    "gradient_stats",
    "has_errors",
    "load_config",
    "optimizer_facts",
    "run_static_rules",
    "sort_findings",
    "update_stats",
]
