"""Save an optimizer and its params through torch.save, rebuild, and load (weights_only)."""

from __future__ import annotations

import io

import torch

from mixprec.optim import AdamW


def reload(
    opt: AdamW, params: list[torch.Tensor], **kw: object
) -> tuple[AdamW, list[torch.Tensor]]:
    """A new `AdamW(**kw)` on copies of `params`, loaded from `opt`'s saved state dict."""
    buf = io.BytesIO()
    torch.save({"opt": opt.state_dict(), "params": [p.detach() for p in params]}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    fresh = [p.clone().requires_grad_() for p in saved["params"]]
    new_opt = AdamW(fresh, **kw)  # type: ignore[arg-type]
    new_opt.load_state_dict(saved["opt"])
    return new_opt, fresh
