"""What `Precision.prepare` does to a model: fp32 islands, then parameter storage.

Modules the plan's island rule names become fp32 islands (`mixprec.islands`:
forward hooks, nothing replaced); their parameters are kept in fp32 and every
other floating parameter is cast to the plan's storage dtype, in place
(``p.data``, so the parameter objects an optimizer may already hold stay the
same). Buffers are left as they are.
"""

from __future__ import annotations

import torch
from torch import nn

from mixprec.engine.plan import PrecisionPlan
from mixprec.islands import add_fp32_islands, is_fp32_island, island_names

__all__ = ["apply_storage"]


def apply_storage(model: nn.Module, plan: PrecisionPlan, device_type: str) -> tuple[str, ...]:
    """Apply the plan's islands and storage dtype to `model`.

    Modules that were islands already (a second `prepare`) keep fp32 parameters.

    Returns:
        The qualified names of the modules that run as fp32 islands.
    """
    storage = plan.storage_dtype
    add_fp32_islands(model, plan.islands, device_type)
    island_params = {id(p) for m in model.modules() if is_fp32_island(m) for p in m.parameters()}
    with torch.no_grad():
        for p in model.parameters():
            if not p.is_floating_point():
                continue
            target = torch.float32 if id(p) in island_params else storage
            if p.dtype != target:
                p.data = p.data.to(target)
    return island_names(model)
