"""torch's optimizer options: checked as torch checks them, refused where unsupported.

`check_hyper` is Adam's and AdamW's, `check_sgd` SGD's, `check_lion` Lion's;
`refuse_unsupported` and `check_options` apply to every mixprec optimizer.
"""

from __future__ import annotations

import math
from numbers import Integral, Real
from typing import Any, cast

import torch

from mixprec.formats import check_master, check_moments

__all__ = [
    "check_formats",
    "check_hyper",
    "check_lion",
    "check_options",
    "check_sgd",
    "refuse_unsupported",
    "scalar",
]


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
    """torch options no mixprec optimizer can honour raise, never pass silently."""
    if options.get("capturable"):
        raise ValueError(
            f"{where}capturable=True is not supported: mixprec's optimizers read the step "
            "count on the host, so a step cannot be captured in a CUDA graph; use "
            "capturable=False"
        )
    if options.get("differentiable"):
        raise ValueError(
            f"{where}differentiable=True is not supported: the fused step writes the "
            "parameters and state in place outside autograd; use differentiable=False"
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


def check_formats(group: dict[str, Any]) -> None:
    """A param group's ``master`` and ``moments`` (the registry now: formats added later too)."""
    check_master(group["master"], auto=True)
    check_moments(group["moments"])


def _check_lr(lr: object) -> None:
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
    elif isinstance(lr, bool) or not isinstance(lr, Real):
        raise ValueError(f"Invalid learning rate: {lr!r} (a float or a 1-element Tensor)")
    if not (scalar(lr) >= 0.0 and math.isfinite(scalar(lr))):
        raise ValueError(f"Invalid learning rate: {scalar(lr)} (a finite number >= 0)")


def _check_number(name: str, value: object, *, low: float | None = 0.0) -> None:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = scalar(value)
    ok = isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or (low is not None and value < low):  # type: ignore[operator]
        bound = "" if low is None else f" >= {low:g}"
        raise ValueError(f"Invalid {name} value: {value!r} (a finite number{bound})")


def check_sgd(
    lr: object, momentum: object, dampening: object, weight_decay: object, nesterov: object
) -> None:
    """`torch.optim.SGD`'s checks and messages, plus finite values."""
    _check_lr(lr)
    _check_number("momentum", momentum)
    _check_number("dampening", dampening, low=None)
    _check_number("weight_decay", weight_decay)
    if not isinstance(nesterov, bool):
        raise TypeError(f"nesterov must be True or False, got {nesterov!r}")
    if nesterov and (scalar(momentum) <= 0 or scalar(dampening) != 0):
        raise ValueError("Nesterov momentum requires a momentum and zero dampening")


def check_lion(lr: object, betas: object, weight_decay: object) -> None:
    """Lion's hyperparameters: lr and weight_decay finite and >= 0, both betas in [0, 1]."""
    _check_lr(lr)
    if not (isinstance(betas, tuple | list) and len(betas) == 2):
        raise ValueError(f"Invalid betas {betas!r}: must be a pair (beta1, beta2) in [0, 1]")
    for i, beta in enumerate(betas):
        _check_number(f"beta at index {i}", beta)
        if scalar(beta) > 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {scalar(beta)} (in [0, 1])")
    _check_number("weight_decay", weight_decay)
