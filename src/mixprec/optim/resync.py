"""Re-syncing a master with a parameter that was written outside the optimizer.

Training code edits weights in place between steps: magnitude pruning
(``w.mul_(mask)``), ``p.zero_()``, re-initialising a layer. The master must
follow the edit, and must never decode to NaN: a bf16 value of 0 joined with
the stale negative remainder of the old value is a NaN bit pattern.

An element is *stale* when its decoded master lies more than half an ulp of the
stored parameter away from it (a master rounds to its parameter, ties either
way), or decodes to a non-finite value while the parameter is finite. For a
stale element the state is replaced by the state of a master equal to the
parameter (remainder 0, compensation 0, fp32 copy = parameter). Elements the
edit left alone keep their full precision.
"""

from __future__ import annotations

import torch

from mixprec.dtypes import ulp
from mixprec.formats import MasterFormat

__all__ = ["resync_master"]


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
    flat = param.reshape(-1)
    flat_state = [s.view(-1) for s in state]
    decoded = fmt.decode(flat, flat_state)
    value = flat.to(torch.float32)
    distance = (decoded.to(torch.float64) - value.to(torch.float64)).abs()
    stale = distance > 0.5 * ulp(flat, flat.dtype)  # NaN for a non-finite param: not stale
    stale |= ~torch.isfinite(decoded) & torch.isfinite(value)
    count = int(stale.sum())
    if count:
        _, fresh = fmt.encode(flat.to(torch.float32), dtype=param.dtype, noise=None)
        for dst, src in zip(flat_state, fresh, strict=True):
            dst.copy_(torch.where(stale, src.to(dst.dtype), dst))
    return count
