"""What `Precision.prepare` does to a model: fp32 islands, then parameter storage.

Modules the plan's island rule names become fp32 islands (`mixprec.islands`:
forward hooks, nothing replaced); their parameters are kept in fp32 and every
other floating parameter is cast to the plan's storage dtype, in place
(``p.data``, so the parameter objects an optimizer may already hold stay the
same). Buffers are left as they are.

With 16-bit storage the model's root also gets a forward pre-hook that casts
floating inputs to the storage dtype when autocast is off (as FSDP2's
``cast_forward_inputs`` does), so an evaluation loop written the torch way,
outside `Precision.autocast`, runs instead of failing on mixed dtypes. Under
autocast the hook does nothing: autocast chooses op dtypes.

A model given already compiled (``torch.compile(model)``, an ``OptimizedModule``
whose submodule names all start with ``_orig_mod.``) is prepared through the
module it runs (`compiled_inner`), so fp32 module names match as they would on
the plain model.

`forward_autocast` is the autocast a forward runs under (`Precision.autocast`), with
its backward traced outside it when compiled.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch._functorch.config
from torch import nn
from torch.utils._pytree import tree_map

from mixprec.engine.plan import PrecisionPlan
from mixprec.engine.wrappers import storage_change_refused
from mixprec.islands import add_fp32_islands, is_fp32_island, island_names

__all__ = ["CastInputs", "apply_storage", "compiled_inner", "forward_autocast"]

_ATTR = "_mixprec_cast_inputs"  # on the root module: the pre-hook's id


class CastInputs:
    """Forward pre-hook: floating inputs to `dtype` when autocast is off on `device_type`."""

    def __init__(self, dtype: torch.dtype, device_type: str) -> None:
        self.dtype = dtype
        self.device_type = device_type

    def _cast(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.to(self.dtype)
        return value

    def __call__(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if torch.is_autocast_enabled(self.device_type):
            return None
        return tree_map(self._cast, args), tree_map(self._cast, kwargs)


def compiled_inner(model: nn.Module) -> nn.Module:
    """The module that `torch.compile`'s wrapper `model` runs, or `model` itself."""
    # A wrapper exists only once dynamo is imported; importing it here would cost
    # seconds to every prepare.
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is not None and isinstance(model, eval_frame.OptimizedModule):
        inner: nn.Module = model._orig_mod
        return inner
    return model


def _set_input_cast(model: nn.Module, dtype: torch.dtype, device_type: str) -> None:
    old = getattr(model, _ATTR, None)
    if old is not None:  # a second prepare replaces the first one's hook
        model._forward_pre_hooks.pop(old, None)
        model._forward_pre_hooks_with_kwargs.pop(old, None)
        delattr(model, _ATTR)
    if dtype == torch.float32 or is_fp32_island(model):
        return
    handle = model.register_forward_pre_hook(CastInputs(dtype, device_type), with_kwargs=True)
    setattr(model, _ATTR, handle.id)


def apply_storage(model: nn.Module, plan: PrecisionPlan, device_type: str) -> tuple[str, ...]:
    """Apply the plan's islands and storage dtype to `model`.

    Modules that were islands already (a second `prepare`) keep fp32 parameters.
    Nothing changes when a parameter of a model already wrapped by FSDP2 or DDP
    would change dtype (`PrecisionError` naming the right order).

    Returns:
        The qualified names of the modules that run as fp32 islands.
    """
    storage = plan.storage_dtype
    islands = [m for _, m in plan.islands.named_modules(model)]
    islands += [m for m in model.modules() if is_fp32_island(m)]
    island_params = {id(p) for m in islands for p in m.parameters()}
    targets = [
        (p, torch.float32 if id(p) in island_params else storage)
        for p in model.parameters()
        if p.is_floating_point()
    ]
    storage_change_refused(model, sum(p.dtype != t for p, t in targets), plan)
    add_fp32_islands(model, plan.islands, device_type)
    with torch.no_grad():
        for p, target in targets:
            if p.dtype != target:
                p.data = p.data.to(target)
    _set_input_cast(model, storage, device_type)
    return island_names(model)


@contextlib.contextmanager
def forward_autocast(device_type: str, dtype: torch.dtype) -> Iterator[None]:
    """``torch.autocast`` for a forward pass whose backward runs after it, outside.

    ``torch.compile`` traces a region's backward together with its forward, by
    default under the autocast active then (``backward_pass_autocast`` is
    ``"same_as_forward"`` up to at least torch 2.13): the matmuls in the backward of
    an fp32 island (a Linear named in ``fp32_modules``) then computed in 16 bits,
    only when compiled (pytorch/pytorch#179804). ``"off"`` is what eager does when
    the backward runs outside autocast, as in the documented loop. Torch before 2.9
    has no such setting.
    """
    backward = (
        torch._functorch.config.patch(backward_pass_autocast="off")
        if hasattr(torch._functorch.config, "backward_pass_autocast")
        else contextlib.nullcontext()
    )
    with backward, torch.autocast(device_type=device_type, dtype=dtype):
        yield
