"""The static rules in the order they run, and running them."""

from __future__ import annotations

from collections.abc import Callable

from mixprec.doctor.facts import TrainingFacts
from mixprec.doctor.findings import Finding
from mixprec.doctor.rules.devices import format_not_accelerated, reduce_dtype_16bit
from mixprec.doctor.rules.scaling import (
    fp8_without_scaling,
    fp16_without_loss_scaling,
    loss_scaling_unneeded,
)
from mixprec.doctor.rules.storage import (
    master_without_16bit_params,
    norm_in_16bit,
    optimizer_state_16bit,
)
from mixprec.doctor.rules.wrappers import fsdp_without_mixed_precision

__all__ = ["STATIC_RULE_FUNCTIONS", "run_static_rules"]


#: The static rules, in documentation order.
STATIC_RULE_FUNCTIONS: tuple[Callable[[TrainingFacts], list[Finding]], ...] = (
    optimizer_state_16bit,
    fp16_without_loss_scaling,
    loss_scaling_unneeded,
    reduce_dtype_16bit,
    fsdp_without_mixed_precision,
    master_without_16bit_params,
    format_not_accelerated,
    norm_in_16bit,
    fp8_without_scaling,
)


def run_static_rules(facts: TrainingFacts) -> list[Finding]:
    """Every static rule's findings for `facts`."""
    return [f for rule in STATIC_RULE_FUNCTIONS for f in rule(facts)]
