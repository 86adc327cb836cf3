"""fp32 islands: modules kept in fp32 inside a 16-bit model, by forward hooks.

Norm layers (by default) keep fp32 parameters under 16-bit storage policies, and
run in fp32: their floating inputs are upcast, autocast is off inside, and the
output goes back to the dtype of the first floating input, so the 16-bit model
around the island sees the dtype it passed in.

An island is a pair of forward hooks on the module, nothing else: the module's
``forward``, its class and torch are left alone, ``state_dict`` keys do not
change, and the hooks are a small picklable object. So ``copy.deepcopy(model)``
(an EMA or teacher copy, ``torch.optim.swa_utils.AveragedModel``) gets islands
of its own that use its own parameters, and ``torch.save(model)`` works. The
post-hook is registered with ``always_call=True``, so autocast is restored even
when the forward raises.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from mixprec.policy import Policy, matches_fp32_module

__all__ = [
    "Fp32Island",
    "add_fp32_island",
    "add_fp32_islands",
    "is_fp32_island",
    "remove_fp32_island",
    "temporary_fp32_islands",
]

_ATTR = "_mixprec_fp32_island"  # on the module: (island, pre-hook id, post-hook id)


def _cast_floating(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(dtype)
    if isinstance(value, tuple | list):
        return type(value)(_cast_floating(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast_floating(v, dtype) for k, v in value.items()}
    return value


def _first_floating_dtype(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.dtype | None:
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return a.dtype
    return None


class Fp32Island:
    """The forward hooks that run one module in fp32 (see the module docs).

    Args:
        device_type: the device type whose autocast is turned off inside.
    """

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type
        self._calls: list[tuple[contextlib.AbstractContextManager[Any], torch.dtype | None]] = []

    def before(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Forward pre-hook: upcast floating inputs, turn autocast off."""
        in_dtype = _first_floating_dtype(args, kwargs)
        off = torch.autocast(device_type=self.device_type, enabled=False)
        off.__enter__()  # type: ignore[no-untyped-call]
        self._calls.append((off, in_dtype))
        return _cast_floating(args, torch.float32), _cast_floating(kwargs, torch.float32)

    def after(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> Any:
        """Forward hook (always called): restore autocast, cast outputs back."""
        off, in_dtype = self._calls.pop()
        off.__exit__(None, None, None)
        if output is not None and in_dtype is not None and in_dtype != torch.float32:
            return _cast_floating(output, in_dtype)
        return output

    def __getstate__(self) -> dict[str, Any]:
        return {"device_type": self.device_type}  # calls in flight are never copied

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["device_type"])  # type: ignore[misc]


def is_fp32_island(module: nn.Module) -> bool:
    """Whether `module` runs as an fp32 island."""
    return getattr(module, _ATTR, None) is not None


def add_fp32_island(module: nn.Module, device_type: str) -> None:
    """Make `module` an fp32 island (idempotent)."""
    if is_fp32_island(module):
        return
    island = Fp32Island(device_type)
    pre = module.register_forward_pre_hook(island.before, with_kwargs=True)
    post = module.register_forward_hook(island.after, with_kwargs=True, always_call=True)
    setattr(module, _ATTR, (island, pre.id, post.id))


def remove_fp32_island(module: nn.Module) -> None:
    """Undo `add_fp32_island` (no-op for other modules)."""
    entry = getattr(module, _ATTR, None)
    if entry is None:
        return
    _island, pre_id, post_id = entry
    module._forward_pre_hooks.pop(pre_id, None)
    module._forward_pre_hooks_with_kwargs.pop(pre_id, None)
    module._forward_hooks.pop(post_id, None)
    module._forward_hooks_with_kwargs.pop(post_id, None)
    module._forward_hooks_always_called.pop(post_id, None)
    delattr(module, _ATTR)


def add_fp32_islands(model: nn.Module, policy: Policy, device_type: str) -> list[nn.Module]:
    """Make every module of `model` that `policy.fp32_modules` names an island.

    Islands apply only under 16-bit parameter storage (with fp32 storage,
    autocast's own op lists decide). Returns the modules that became islands now.
    """
    added: list[nn.Module] = []
    if policy.param_dtype == torch.float32:
        return added
    for name, module in model.named_modules():
        if matches_fp32_module(policy, name, module) and not is_fp32_island(module):
            add_fp32_island(module, device_type)
            added.append(module)
    return added


@contextlib.contextmanager
def temporary_fp32_islands(model: nn.Module, policy: Policy, device_type: str) -> Iterator[None]:
    """The policy's islands in `model` for the duration of the context (for predictions
    that run a model as `Precision.prepare` would leave it). Islands that already
    existed are kept."""
    added = add_fp32_islands(model, policy, device_type)
    try:
        yield
    finally:
        for module in added:
            remove_fp32_island(module)
