"""What the static rules share: run-length and state-size facts, evidence.

Fix texts, worded per dialect, are in `mixprec.doctor.rules.fixes`.
"""

from __future__ import annotations

from typing import Any

from mixprec.doctor.facts import GroupFacts
from mixprec.floats import canonical_name
from mixprec.formats.registry import master_specs, moment_specs

__all__ = [
    "MASTER_EXTRA_BYTES",
    "ROUNDED_MOMENTS",
    "SHORT_RUN_STEPS",
    "dtype_label",
    "group_evidence",
]

#: A run of at most this many optimizer steps counts as short: bf16 Adam state then
#: gets a warning instead of an error (the damage compounds with the step count).
SHORT_RUN_STEPS = 1000


#: Extra bytes per parameter each master representation costs (beyond the params):
#: mixprec's formats (the registry), plus the 16-bit scaled master of Transformer
#: Engine that configs of other tools can name.
MASTER_EXTRA_BYTES: dict[str, int] = {
    **{spec.name: spec.bytes_per_element for spec in master_specs()},
    "fp16": 2,
}


#: Moment formats whose elements are rounded to a narrow float every step, so small
#: moving-average increments are lost: mixprec's ones (the registry), plus the ones
#: other tools' configs can name (fp16, fp8, int4 without block scales).
ROUNDED_MOMENTS = frozenset(
    {spec.name for spec in moment_specs() if spec.rounds_increments} | {"fp16", "fp8", "int4"}
)


def dtype_label(dtype: object) -> str:
    """A dtype's canonical name for evidence and messages (a fact's name, or a live
    wrapper's `torch.dtype`); ``"none"`` when unknown."""
    return canonical_name(dtype) if dtype is not None else "none"


def group_evidence(groups: list[GroupFacts]) -> list[dict[str, Any]]:
    return [
        {
            "group": g.label,
            "param_dtype": dtype_label(g.param_dtype),
            "master": g.master,
            "moments": g.moments,
            "numel": g.numel,
        }
        for g in groups
    ]
