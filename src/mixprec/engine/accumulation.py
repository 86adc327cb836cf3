"""Gradient accumulation over micro-batches in fp32 (`Fp32Accumulation`).

The hooks hold only weak references: they do nothing once the `Precision` that
owns them is gone. (The watch that catches a plain ``loss.backward()`` under loss
scaling is `mixprec.engine.scaling.ScaledGradients`.)
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch

from mixprec.engine.gradients import SIXTEEN_BIT
from mixprec.errors import PrecisionError
from mixprec.optim.sharding import is_dtensor

__all__ = ["Fp32Accumulation", "refuse_fsdp2"]


def refuse_fsdp2(params: Iterable[torch.Tensor], policy: str) -> None:
    """Raise `PrecisionError` when `params` hold a 16-bit FSDP2 (`DTensor`) parameter:
    FSDP2 sums each backward's gradient into the sharded ``.grad`` in its post-backward
    hook, outside autograd's accumulation, where no tensor hook sees it."""
    if any(is_dtensor(p) and p.dtype in SIXTEEN_BIT and p.requires_grad for p in params):
        raise PrecisionError(
            f"policy {policy!r}: grad_accum_dtype=fp32 cannot reach the gradients of an "
            "FSDP2 model (FSDP2 accumulates them itself); fix: drop grad_accum_dtype and "
            "skip the reduction of all but the last micro-batch "
            "(model.set_requires_gradient_sync(False)): FSDP2 then accumulates unsharded "
            "gradients in its reduce_dtype (fp32)"
        )


class Fp32Accumulation:
    """Sums the gradients of 16-bit parameters in fp32 over the backward passes of a step.

    ``Policy(grad_accum_dtype=torch.float32)``. Autograd adds each backward's gradient
    into ``.grad`` in the parameter's dtype, so under bf16 storage a sum over N
    micro-batches is rounded N - 1 times (its relative error grows with N). Here a
    tensor hook sees each backward's exact incoming gradient and adds it to an fp32
    sum, and a post-accumulate-grad hook writes that sum, rounded once, into
    ``.grad``: after every backward ``.grad`` holds the fp32 sum rounded to the
    parameter's dtype, wherever the loop reads it (clip, unscale, the optimizer).

    A sum exists only from a parameter's second backward of a step (the first
    gradient is stored exactly as is) until `release` (`Precision.step`, applied or
    skipped): 4 bytes per 16-bit parameter while a step accumulates. It continues
    only while ``.grad`` is what the last backward left there: a gradient set to
    None (``zero_grad()``) restarts the sum at the next gradient, and one changed in
    place (``zero_grad(set_to_none=False)``, a clip, a data-parallel reduction that
    writes ``.grad``) restarts it from ``.grad`` as it stands.

    With ``write=False`` nothing is written: the sums only witness what an fp32
    accumulation would hold (the doctor's ``grad-accum-16bit`` measures against them).
    The hooks hold only weak references: they do nothing once the owner is gone.
    """

    def __init__(self, *, write: bool = True) -> None:
        self.write = write
        self._sums: dict[int, torch.Tensor] = {}  # fp32, by id(param)
        self._counts: dict[int, int] = {}  # gradients summed in .grad since it was last set
        self._left: dict[int, tuple[weakref.ref[torch.Tensor], int]] = {}
        self._hooked: dict[int, weakref.ref[torch.Tensor]] = {}
        self._handles: list[Any] = []

    @property
    def nbytes(self) -> int:
        """Bytes the fp32 sums hold now."""
        return sum(t.numel() * t.element_size() for t in self._sums.values())

    @property
    def backwards(self) -> int:
        """The most backward passes whose gradients one parameter's ``.grad`` holds
        summed, since `release` (0: no gradient seen)."""
        return max(self._counts.values(), default=0)

    def sums(self) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
        """(parameter, its fp32 sum, backward passes summed) for each sum held now."""
        out = []
        for key, total in self._sums.items():
            p = self._hooked[key]()
            if p is not None:
                out.append((p, total, self._counts.get(key, 0)))
        return out

    def release(self) -> None:
        """Free every sum (the step consumed the gradients)."""
        self._sums.clear()
        self._counts.clear()
        self._left.clear()

    def hook(self, params: Iterable[torch.Tensor]) -> None:
        """Sum the gradients of the 16-bit dense parameters among `params` in fp32."""
        owner = weakref.ref(self)
        for p in params:
            known = self._hooked.get(id(p))
            if not p.requires_grad or p.dtype not in SIXTEEN_BIT or p.layout != torch.strided:
                continue
            if known is not None and known() is p:
                continue
            param = weakref.ref(p)

            def incoming(grad: torch.Tensor, param: weakref.ref[torch.Tensor] = param) -> None:
                acc, p_ = owner(), param()
                if acc is not None and p_ is not None:
                    acc._add(p_, grad)

            def accumulated(p_: torch.Tensor) -> None:
                acc = owner()
                if acc is not None:
                    acc._accumulated(p_)

            self._handles.append(p.register_hook(incoming))  # type: ignore[no-untyped-call]
            self._handles.append(
                p.register_post_accumulate_grad_hook(accumulated)  # type: ignore[no-untyped-call]
            )
            self._hooked[id(p)] = param

    def unhook(self) -> None:
        """Remove every hook and free every sum."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._hooked.clear()
        self.release()

    def _add(self, p: torch.Tensor, grad: torch.Tensor) -> None:
        key, held = id(p), p.grad
        left = self._left.get(key)
        continues = (
            held is not None and left is not None and left[0]() is held and left[1] == held._version
        )
        self._counts[key] = self._counts.get(key, 0) + 1 if continues else 1
        if held is None or grad.layout != torch.strided:
            self._sums.pop(key, None)  # the first gradient: stored exactly as is
            return
        total = self._sums.get(key)
        with torch.no_grad():
            if total is None:
                total = held.to(torch.float32, copy=True)
                self._sums[key] = total
            elif not continues:
                total.copy_(held)
            total.add_(grad)

    def _accumulated(self, p: torch.Tensor) -> None:
        total, held = self._sums.get(id(p)), p.grad
        if held is None:
            return
        if total is not None and self.write:
            with torch.no_grad():
                held.copy_(total)  # the one rounding of the fp32 sum
        self._left[id(p)] = (weakref.ref(held), held._version)
