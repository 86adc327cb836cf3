"""torch.optim.AdamW's options: checked as torch checks them, refused where unsupported."""

from __future__ import annotations

import math
from numbers import Integral, Real
from typing import Any, cast

import torch

from mixprec.formats import check_master, check_moments

__all__ = ["check_group", "check_hyper", "check_options", "refuse_unsupported", "scalar"]


def scalar(value: object) -> float:
    """A float from a float or a 1-element Tensor (torch accepts both for lr and betas)."""
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)  # type: ignore[arg-type]


def check_hyper(
    lr: float | torch.Tensor,
    betas: tuple[float | torch.Tensor, float | torch.Tensor],
    eps: float,
    weight_decay: float,
    *,
    foreach: bool | None = None,
    capturable: bool = False,
) -> None:
    """torch's checks and messages (so torch code fails alike), plus mixprec's eps > 0."""
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        if foreach and not capturable:
            raise ValueError(
                "lr as a Tensor is not supported for capturable=False and foreach=True"
            )
    elif isinstance(lr, bool) or not isinstance(lr, Real):  # numpy's floats are Real
        raise ValueError(f"Invalid learning rate: {lr!r} (a float or a 1-element Tensor)")
    if not scalar(lr) >= 0.0:
        raise ValueError(f"Invalid learning rate: {scalar(lr)} (must be >= 0)")
    if not (isinstance(betas, tuple | list) and len(betas) == 2):
        raise ValueError(f"Invalid betas {betas!r}: must be a pair (beta1, beta2) in [0, 1)")
    tensors = [isinstance(b, torch.Tensor) for b in betas]
    if any(tensors):
        if not all(tensors):
            raise ValueError("betas must be either both floats or both Tensors")
        if foreach and not capturable:
            raise ValueError(
                "betas[0] as a Tensor is not supported for capturable=False and foreach=True"
            )
        if any(cast(torch.Tensor, b).numel() != 1 for b in betas):
            raise ValueError("Tensor betas must be 1-element")
    for i, beta in enumerate(betas):
        if isinstance(beta, bool) or not isinstance(beta, Real | torch.Tensor):
            raise ValueError(f"Invalid beta parameter at index {i}: {beta!r} (a float in [0, 1))")
        if not 0.0 <= scalar(beta) < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {scalar(beta)} (in [0, 1))")
    if not (
        isinstance(eps, Real) and not isinstance(eps, bool) and eps > 0.0 and math.isfinite(eps)
    ):
        raise ValueError(
            f"Invalid epsilon value: {eps!r}: must be a finite number > 0 (with eps=0 a zero "
            "gradient and a zero second moment give 0/0 = NaN in the update)"
        )
    if isinstance(weight_decay, torch.Tensor) and weight_decay.numel() == 1:
        wd_ok = scalar(weight_decay) >= 0.0  # torch takes a 1-element Tensor too
    else:
        wd_ok = (
            isinstance(weight_decay, Real)
            and not isinstance(weight_decay, bool)
            and weight_decay >= 0.0
        )
    if not wd_ok:
        raise ValueError(f"Invalid weight_decay value: {weight_decay!r} (must be >= 0)")


def refuse_unsupported(where: str, options: dict[str, Any]) -> None:
    """torch.optim.AdamW options this optimizer cannot honour raise, never pass silently."""
    if options.get("amsgrad"):
        raise ValueError(
            f"{where}amsgrad=True is not supported by mixprec.optim.AdamW (its running maximum "
            "of the second moment has no storage format here); use torch.optim.AdamW for "
            "AMSGrad, or amsgrad=False"
        )
    if options.get("capturable"):
        raise ValueError(
            f"{where}capturable=True is not supported: mixprec.optim.AdamW reads the step count "
            "on the host, so its step cannot be captured in a CUDA graph; use capturable=False"
        )
    if options.get("differentiable"):
        raise ValueError(
            f"{where}differentiable=True is not supported: the fused step writes the "
            "parameters and state in place outside autograd; use differentiable=False"
        )
    if "decoupled_weight_decay" in options and not options["decoupled_weight_decay"]:
        raise ValueError(
            f"{where}decoupled_weight_decay=False (Adam with L2 decay, torch.optim.Adam's "
            "option) is not supported: mixprec.optim.AdamW decays the weights decoupled, "
            "as torch.optim.AdamW does; drop the key (or set it True), or use "
            "weight_decay=0 and add the L2 term to the loss"
        )
    foreach = options.get("foreach")
    if foreach is not None and not isinstance(foreach, bool):
        raise TypeError(f"{where}foreach must be True, False or None, got {foreach!r}")


def check_options(fused: object, block_size: int, min_int8_numel: int, seed: object) -> int:
    """`AdamW`'s own options checked; returns the rounding seed (``None``: read from
    torch's default generator without advancing it, so swapping torch.optim.AdamW for
    mixprec's does not change the program's later random draws)."""
    if fused is not None and not isinstance(fused, bool):
        raise TypeError(f"fused must be True, False or None, got {fused!r}")
    if block_size < 1 or min_int8_numel < 0:
        raise ValueError(
            f"invalid block_size {block_size!r} / min_int8_numel {min_int8_numel!r}: "
            "need block_size >= 1 and min_int8_numel >= 0"
        )
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, Integral)):
        raise TypeError(f"seed must be an int or None, got {seed!r}")
    if seed is not None and not 0 <= int(seed) < 2**32:
        raise ValueError(
            f"seed must be in [0, 2**32) (the rounding noise is keyed by 32 bits), got {seed}"
        )
    if seed is None:
        with torch.random.fork_rng(devices=[]):
            return int(torch.randint(0, 2**31 - 1, (), dtype=torch.int64).item())
    return int(seed)


def check_group(group: dict[str, Any]) -> None:
    """A param group's options, hyperparameters and formats, as it is added."""
    refuse_unsupported("param group: ", group)
    check_hyper(
        group["lr"],
        group["betas"],
        group["eps"],
        group["weight_decay"],
        foreach=group.get("foreach"),
        capturable=bool(group.get("capturable")),
    )
    check_master(group["master"], auto=True)  # the registry now: formats added later too
    check_moments(group["moments"])
