"""Loading a saved optimizer state, converting it across policies and optimizers.

Without conversion the state goes to ``optimizer.load_state_dict`` as saved.
With it (`mixprec.checkpoint.load(convert=True)`), a state saved by
`mixprec.optim.AdamW` is first read by a scratch `AdamW` of the saved formats over
the saved weights, which gives each parameter's fp32 master (remainders and
compensations included) and its moments decoded to fp32. Those go to the new
optimizer as a torch AdamW state dict (moments re-encoded into its formats), and
the masters are loaded last (`AdamW.load_master_weights`), so an fp32 master
carried into an ``exact`` one loses nothing. A torch optimizer as the target gets
the same torch state dict and the masters written into its (fp32) parameters.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["load_optimizer"]

_MIXPREC_ADAMW = "mixprec.optim.AdamW"


def load_optimizer(
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    *,
    saved_kind: str | None,
    saved_model: Mapping[str, Any],
    names: Mapping[torch.Tensor, str],
    convert: bool,
) -> list[str]:
    """Load `state` (integer ids, this optimizer's order) and say what was converted.

    Args:
        optimizer: the optimizer to load into.
        state: the saved state dict, its ids mapped to this optimizer's parameters.
        saved_kind: the saved optimizer's class name.
        saved_model: the saved model state dict (the saved parameters, for masters).
        names: each parameter's name in the model.
        convert: the policy or the optimizer differ: convert rather than load as is.
    """
    from mixprec.optim import AdamW

    if not convert or saved_kind != _MIXPREC_ADAMW:
        optimizer.load_state_dict(state)  # a torch state dict converts inside AdamW
        conversion = getattr(optimizer, "last_conversion", None)
        if conversion is not None and conversion.converted:
            return [f"optimizer: {conversion.describe()}"]
        return []
    params = [p for group in optimizer.param_groups for p in group["params"]]
    scratch_params = [
        nn.Parameter(saved_model[names[p]].detach().clone(), requires_grad=p.requires_grad)
        for p in params
    ]
    groups, start = [], 0
    for saved, mine in zip(state["param_groups"], optimizer.param_groups, strict=True):
        count = len(mine["params"])
        groups.append(
            {
                **{k: v for k, v in saved.items() if k != "params"},
                "params": scratch_params[start : start + count],
            }
        )
        start += count
    scratch = AdamW(groups)
    scratch.load_state_dict(state)
    masters = scratch.master_weights()
    torch_state = scratch.torch_state_dict(moments_dtype=torch.float32)
    before = [f"{m}/{v}" for m, v in sorted(set(scratch.formats()))]
    with torch.no_grad():
        if isinstance(optimizer, AdamW):
            optimizer.load_state_dict(torch_state)
            optimizer.load_master_weights(masters)
            after = [f"{m}/{v}" for m, v in sorted(set(optimizer.formats()))]
        else:
            for p, master in zip(params, masters, strict=True):
                p.copy_(master)
            optimizer.load_state_dict(torch_state)
            after = [f"{type(optimizer).__name__} (no master)"]
    return [
        f"optimizer: {len(params)} parameter(s) from {before} to {after}: masters decoded "
        "to fp32 and re-encoded, moments through fp32"
    ]
