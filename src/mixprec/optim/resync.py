"""Masters of parameters that were written outside the optimizer.

Training code writes weights in place between steps: loading a checkpoint or
other weights, re-initialising a layer, magnitude pruning (``w.mul_(mask)``),
``p.zero_()``. A remainder or compensation is relative to the value the
optimizer last wrote, and which elements an edit changed cannot be told from
the new values alone (the old remainder joined with a new value is still a
valid master within half an ulp of it). So:

* `reset_master`: after an edit, the master becomes the parameter's value
  exactly (remainder 0, compensation 0, fp32 copy = parameter). Elements the
  edit left alone lose their sub-16-bit part once (at most half an ulp).
* `resync_master`: when the edit is known to restore the values the state
  belongs to (the model checkpoint of a resume, right after the optimizer's
  state was loaded), the loaded master is kept wherever it still matches: an
  element is *stale* when its decoded master lies more than half an ulp of the
  parameter away, or decodes to a non-finite value while the parameter is
  finite, and only stale elements are reset. A master never decodes to NaN.
"""

from __future__ import annotations

import torch

from mixprec.dtypes import ulp
from mixprec.formats import MasterFormat
from mixprec.optim.layout import flat_view

__all__ = ["reset_master", "resync_master"]


@torch.no_grad()
def resync_master(fmt: MasterFormat, param: torch.Tensor, state: list[torch.Tensor]) -> int:
    """Re-sync `state` (the format's tensors, in `state_keys` order) with `param`.

    Args:
        fmt: the master format.
        param: the stored parameter (local tensor, any shape).
        state: the master's state tensors, shaped like `param` (changed in place).

    Returns:
        How many elements were stale.
    """
    if not fmt.spec.state_keys or fmt.spec.uses_noise:
        return 0  # no master state (none, stochastic): the parameter is the master
    flat = flat_view(param)
    flat_state = [flat_view(s) for s in state]
    decoded = fmt.decode(flat, flat_state)
    value = flat.to(torch.float32)
    distance = (decoded.to(torch.float64) - value.to(torch.float64)).abs()
    stale = distance > 0.5 * ulp(flat, flat.dtype)  # NaN for a non-finite param: not stale
    stale |= ~torch.isfinite(decoded) & torch.isfinite(value)
    stale |= value == 0  # a pruned or zeroed element: its master is 0, not a stale denormal
    count = int(stale.sum())
    if count:
        _, fresh = fmt.encode(flat.to(torch.float32), dtype=param.dtype, noise=None)
        for dst, src in zip(flat_state, fresh, strict=True):
            dst.copy_(torch.where(stale, src.to(dst.dtype), dst))
    return count


@torch.no_grad()
def reset_master(fmt: MasterFormat, param: torch.Tensor, state: list[torch.Tensor]) -> None:
    """Make the master equal to `param` exactly (`state` in `state_keys` order, in place)."""
    if not fmt.spec.state_keys:
        return
    fresh = fmt.init_state(param)
    for dst, key in zip(state, fmt.spec.state_keys, strict=True):
        src = fresh[key]
        # (a parameter re-pointed by `p.set_(t)` to another shape of the same size: its
        # state keeps its shape, and is stepped element by element as after `p.data = t`)
        dst.copy_(src if src.shape == dst.shape else src.reshape(dst.shape))
