"""The static rules: pure functions from `TrainingFacts` to findings.

Each rule looks only at the facts it needs and stays silent when one of them is
unknown. Numbers in messages and evidence come from `mixprec.dtypes.format_info`,
never from literals.
"""

from mixprec.doctor.rules.common import MASTER_EXTRA_BYTES, SHORT_RUN_STEPS
from mixprec.doctor.rules.devices import format_not_accelerated, reduce_dtype_16bit
from mixprec.doctor.rules.scaling import (
    fp8_without_scaling,
    fp16_without_loss_scaling,
    loss_scaling_unneeded,
)
from mixprec.doctor.rules.static import STATIC_RULE_FUNCTIONS, run_static_rules
from mixprec.doctor.rules.storage import (
    master_without_16bit_params,
    norm_in_16bit,
    optimizer_state_16bit,
)
from mixprec.doctor.rules.wrappers import fsdp_without_mixed_precision

__all__ = [
    "MASTER_EXTRA_BYTES",
    "SHORT_RUN_STEPS",
    "STATIC_RULE_FUNCTIONS",
    "format_not_accelerated",
    "fp8_without_scaling",
    "fp16_without_loss_scaling",
    "fsdp_without_mixed_precision",
    "loss_scaling_unneeded",
    "master_without_16bit_params",
    "norm_in_16bit",
    "optimizer_state_16bit",
    "reduce_dtype_16bit",
    "run_static_rules",
]
