"""The update rules: what one optimizer step computes for each element, in fp32.

A `Rule` is the part of a step that does not depend on storage: the moments it
keeps (`Rule.slots`: a state key and its kind, ``signed`` like a momentum or
``square`` like a second moment), the per-step scalars (`Rule.scalars`: computed
in float64 from the group's hyperparameters and the step count, then rounded to
fp32, as torch computes its own) and the elementwise math on fp32 values
(`Rule.math`). The master and moment formats decode before it and encode after it
(`mixprec.optim.kernels.step_`); the native kernel restates each rule's math in
the same operation order (every product and sum rounded on its own), so every
path gives the same bits.

A param group's rule is fixed when the group is added: ``AdamW(amsgrad=True)``
steps with ``adamw_amsgrad``, ``SGD(momentum=0.9, nesterov=True)`` with
``sgd_nesterov``. Each rule reads five hyperparameters (`Hyper`), whose meaning is
the rule's (`Rule.hyper_names`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mixprec.formats.rounding import sqrt_rn

__all__ = ["RULES", "SIGNED", "SQUARE", "Hyper", "Rule", "rule"]

#: Five hyperparameters of a group as floats, in the rule's order (`Rule.hyper_names`).
Hyper = tuple[float, float, float, float, float]
#: A moment kind: ``signed`` (a running mean of gradients) or ``square`` (of squares:
#: never negative, stored through its square root by the quantized formats).
SIGNED, SQUARE = "signed", "square"

Moments = tuple[torch.Tensor, ...]
Math = Callable[[torch.Tensor, torch.Tensor, Moments, torch.Tensor], tuple[torch.Tensor, Moments]]


@dataclass(frozen=True)
class Rule:
    """One update rule (see the module).

    Attributes:
        name: its name (``adamw``, ``adamw_amsgrad``, ``sgd_momentum``, ...).
        code: its case in the native kernel (``-DMIXPREC_RULE_<NAME>=<code>``).
        slots: the moments it keeps, ``(state key, kind)`` in the order `math` takes them.
        hyper_names: what its `Hyper` holds, for messages (``-``: unused, 0.0).
        read: ``group -> Hyper`` (what a step reads from its param group).
        scalars: ``(hyper, step) -> 7 floats`` (float64 values; the kernels round them
            to fp32). ``step`` is 1 for the first update.
        math: ``(value, grad, moments, scalars) -> (value, moments)`` on fp32 tensors:
            the master value, the gradient (negated for ``maximize``), the decoded
            moments and the fp32 scalars as one vector.
        valid: whether a `Hyper` is in the range the math is defined for (the native
            kernel checks the same bounds; a group edited out of range is refused).
    """

    name: str
    code: int
    slots: tuple[tuple[str, str], ...]
    hyper_names: tuple[str, str, str, str, str]
    read: Callable[[dict[str, Any]], Hyper]
    scalars: Callable[[Hyper, int], tuple[float, ...]]
    math: Math
    valid: Callable[[Hyper], bool]

    @property
    def kinds(self) -> tuple[str, ...]:
        """The kind of each moment slot, in order."""
        return tuple(kind for _, kind in self.slots)

    def scalar_tensor(self, hyper: Hyper, step: int, device: torch.device) -> torch.Tensor:
        """`scalars` as the fp32 vector `math` takes (passed as data, not constants)."""
        return torch.tensor(self.scalars(hyper, step), dtype=torch.float32, device=device)

    def __reduce__(self) -> tuple[Callable[[str], Rule], tuple[str]]:
        # By name: a copied or pickled optimizer's plans refer to the same rule.
        return rule, (self.name,)

    def check(self, hyper: Hyper, index: int) -> None:
        """Raise `ValueError` naming group `index`'s values when `valid` refuses them."""
        if not self.valid(hyper):
            shown = ", ".join(f"{k}={v!r}" for k, v in zip(self.hyper_names, hyper, strict=True))
            raise ValueError(
                f"param group {index}: {shown}: out of range for {self.name} (finite values, "
                "within the bounds its constructor checks); nothing was stepped"
            )


def _finite(*values: float) -> bool:
    return all(math.isfinite(v) for v in values)


# -- Adam and AdamW ---------------------------------------------------------------------
# scalars: [decay (AdamW: 1 - lr * wd) or wd (Adam's L2 term), 1 - beta1, beta2,
#           1 - beta2, -lr / (1 - beta1**step), 1 / sqrt(1 - beta2**step), eps]


def _adam_scalars(decoupled: bool) -> Callable[[Hyper, int], tuple[float, ...]]:
    def scalars(hyper: Hyper, step: int) -> tuple[float, ...]:
        lr, beta1, beta2, eps, wd = hyper
        return (
            1.0 - lr * wd if decoupled else wd,
            1.0 - beta1,
            beta2,
            1.0 - beta2,
            -lr / (1.0 - beta1**step),
            1.0 / math.sqrt(1.0 - beta2**step),
            eps,
        )

    return scalars


def _adam_math(decoupled: bool, amsgrad: bool) -> Math:
    def adam(
        p: torch.Tensor, g: torch.Tensor, moments: Moments, s: torch.Tensor
    ) -> tuple[torch.Tensor, Moments]:
        if decoupled:
            p = p * s[0]
        else:
            g = g + s[0] * p
        m = moments[0] + s[1] * (g - moments[0])
        v = moments[1] * s[2] + s[3] * g * g
        if amsgrad:
            v_max = torch.maximum(moments[2], v)
            denom = sqrt_rn(v_max) * s[5] + s[6]
            out: Moments = (m, v, v_max)
        else:
            denom = sqrt_rn(v) * s[5] + s[6]
            out = (m, v)
        return p + (s[4] * m) / denom, out

    return adam


def _adam_read(group: dict[str, Any]) -> Hyper:
    betas = group["betas"]
    return (
        float(group["lr"]),
        float(betas[0]),
        float(betas[1]),
        float(group["eps"]),
        float(group["weight_decay"]),
    )


def _adam_valid(hyper: Hyper) -> bool:
    lr, beta1, beta2, eps, wd = hyper
    return (
        _finite(lr, eps, wd)
        and lr >= 0.0
        and 0.0 <= beta1 < 1.0
        and 0.0 <= beta2 < 1.0
        and eps > 0.0
        and wd >= 0.0
    )


# -- SGD --------------------------------------------------------------------------------
# scalars: [wd, momentum (0 at the first step), 1 - dampening (1 at the first step),
#           momentum, -lr, 0, 0]. The buffer starts at zero, so the first step makes it
#           0 * 0 + 1 * g = g: torch's clone of the first gradient.


def _sgd_scalars(hyper: Hyper, step: int) -> tuple[float, ...]:
    lr, momentum, dampening, _, wd = hyper
    first = step == 1
    return (wd, 0.0 if first else momentum, 1.0 if first else 1.0 - dampening, momentum, -lr, 0, 0)


def _sgd_math(momentum: bool, nesterov: bool) -> Math:
    def sgd(
        p: torch.Tensor, g: torch.Tensor, moments: Moments, s: torch.Tensor
    ) -> tuple[torch.Tensor, Moments]:
        g = g + s[0] * p
        if not momentum:
            return p + s[4] * g, ()
        buf = moments[0] * s[1] + s[2] * g
        g = g + s[3] * buf if nesterov else buf
        return p + s[4] * g, (buf,)

    return sgd


def _sgd_read(group: dict[str, Any]) -> Hyper:
    lr, momentum, dampening = float(group["lr"]), float(group["momentum"]), group["dampening"]
    if not momentum:  # torch would step without the buffer and keep it: refused, not mimicked
        raise ValueError(
            "param group: momentum=0, but the group was added with a momentum, so its "
            "buffer decides each step; keep momentum > 0 in that group (a schedule may vary "
            "it), or put parameters to step without momentum in a group added with momentum=0"
        )
    return lr, momentum, float(dampening), 0.0, float(group["weight_decay"])


def _sgd_plain_read(group: dict[str, Any]) -> Hyper:
    if group["momentum"]:
        raise ValueError(
            f"param group: momentum={group['momentum']!r}, but the group was added with "
            "momentum=0, so it keeps no momentum buffer; give it a momentum > 0 when it is "
            "added (a scheduler cycling momentum needs one from the start)"
        )
    lr, dampening = float(group["lr"]), float(group["dampening"])
    return lr, 0.0, dampening, 0.0, float(group["weight_decay"])


def _sgd_valid(hyper: Hyper) -> bool:
    lr, momentum, dampening, _, wd = hyper
    return _finite(lr, momentum, dampening, wd) and lr >= 0.0 and momentum >= 0.0 and wd >= 0.0


# -- Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms") ------------
# scalars: [1 - lr * wd, beta1, 1 - beta1, beta2, 1 - beta2, -lr, 0]


def _lion_scalars(hyper: Hyper, step: int) -> tuple[float, ...]:
    lr, beta1, beta2, _, wd = hyper
    return (1.0 - lr * wd, beta1, 1.0 - beta1, beta2, 1.0 - beta2, -lr, 0)


def _lion_math(
    p: torch.Tensor, g: torch.Tensor, moments: Moments, s: torch.Tensor
) -> tuple[torch.Tensor, Moments]:
    m = moments[0]
    update = torch.sign(m * s[1] + s[2] * g)
    p = p * s[0] + s[5] * update
    return p, (m * s[3] + s[4] * g,)


def _lion_read(group: dict[str, Any]) -> Hyper:
    betas = group["betas"]
    return float(group["lr"]), float(betas[0]), float(betas[1]), 0.0, float(group["weight_decay"])


def _lion_valid(hyper: Hyper) -> bool:
    lr, beta1, beta2, _, wd = hyper
    return _finite(lr, wd) and lr >= 0.0 and 0.0 <= beta1 <= 1.0 and 0.0 <= beta2 <= 1.0 and wd >= 0


_ADAM_SLOTS = (("exp_avg", SIGNED), ("exp_avg_sq", SQUARE))
_AMSGRAD_SLOTS = (*_ADAM_SLOTS, ("max_exp_avg_sq", SQUARE))
_ADAM_HYPER = ("lr", "betas[0]", "betas[1]", "eps", "weight_decay")
_SGD_HYPER = ("lr", "momentum", "dampening", "-", "weight_decay")
_LION_HYPER = ("lr", "betas[0]", "betas[1]", "-", "weight_decay")
_MOMENTUM_SLOTS = (("momentum_buffer", SIGNED),)

#: Every rule, by name (codes are the native kernel's cases: never reuse one).
RULES: dict[str, Rule] = {
    r.name: r
    for r in (
        Rule(
            "adamw",
            0,
            _ADAM_SLOTS,
            _ADAM_HYPER,
            _adam_read,
            _adam_scalars(True),
            _adam_math(True, False),
            _adam_valid,
        ),
        Rule(
            "adamw_amsgrad",
            1,
            _AMSGRAD_SLOTS,
            _ADAM_HYPER,
            _adam_read,
            _adam_scalars(True),
            _adam_math(True, True),
            _adam_valid,
        ),
        Rule(
            "adam",
            2,
            _ADAM_SLOTS,
            _ADAM_HYPER,
            _adam_read,
            _adam_scalars(False),
            _adam_math(False, False),
            _adam_valid,
        ),
        Rule(
            "adam_amsgrad",
            3,
            _AMSGRAD_SLOTS,
            _ADAM_HYPER,
            _adam_read,
            _adam_scalars(False),
            _adam_math(False, True),
            _adam_valid,
        ),
        Rule(
            "sgd",
            4,
            (),
            _SGD_HYPER,
            _sgd_plain_read,
            _sgd_scalars,
            _sgd_math(False, False),
            _sgd_valid,
        ),
        Rule(
            "sgd_momentum",
            5,
            _MOMENTUM_SLOTS,
            _SGD_HYPER,
            _sgd_read,
            _sgd_scalars,
            _sgd_math(True, False),
            _sgd_valid,
        ),
        Rule(
            "sgd_nesterov",
            6,
            _MOMENTUM_SLOTS,
            _SGD_HYPER,
            _sgd_read,
            _sgd_scalars,
            _sgd_math(True, True),
            _sgd_valid,
        ),
        Rule(
            "lion",
            7,
            (("exp_avg", SIGNED),),
            _LION_HYPER,
            _lion_read,
            _lion_scalars,
            _lion_math,
            _lion_valid,
        ),
    )
}


def rule(name: str) -> Rule:
    """The rule called `name` (`KeyError` names the known ones)."""
    try:
        return RULES[name]
    except KeyError:
        raise KeyError(f"unknown update rule {name!r}; known: {', '.join(RULES)}") from None
