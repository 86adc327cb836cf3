"""Activation accounting: the bytes a forward (and loss) saves for backward.

Saved tensors are seen through `torch.autograd.graph.saved_tensors_hooks` and
counted once per storage, parameters and buffers excluded (they are held anyway:
components ``params`` and ``buffers``). `saved_activation_bytes` predicts them on
fake tensors; `measure` counts them on a real step with the same hook.
`fake_forward` also says which parameters the forward's graph reaches: those that
get a gradient in a real step.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mixprec.islands import island_param_names, temporary_fp32_islands
from mixprec.policy import Policy, preset

__all__ = [
    "FakeForward",
    "SavedBytes",
    "count_saved",
    "fake_forward",
    "saved_activation_bytes",
    "storage_key",
]


def storage_key(t: torch.Tensor) -> int:
    """An identity for `t`'s storage that also works for fake tensors (no data pointer)."""
    return int(t.untyped_storage()._cdata)


class SavedBytes:
    """Bytes of the tensors saved for backward, unique storages: held now, and the most
    held at once (`peak`: a step that accumulates several micro-batches frees each one's
    saved tensors in its backward, so its peak is about one micro-batch's)."""

    def __init__(self, exclude: set[int]) -> None:
        self.exclude = exclude
        self.now = 0
        self.peak = 0
        self._bytes: dict[int, int] = {}  # storage key -> nbytes, while a saved tensor holds it
        self._holders: dict[int, int] = {}  # storage key -> saved tensors alive

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        """The pack hook: count `t`'s storage until the last saved tensor on it is freed."""
        key = storage_key(t)
        if key in self.exclude:
            return t
        if key not in self._bytes:
            self._bytes[key] = t.untyped_storage().nbytes()
            self.now += self._bytes[key]
            self.peak = max(self.peak, self.now)
        self._holders[key] = self._holders.get(key, 0) + 1
        weakref.finalize(t, self._release, key).atexit = False
        return t

    def _release(self, key: int) -> None:
        self._holders[key] -= 1
        if not self._holders[key]:
            del self._holders[key]
            self.now -= self._bytes.pop(key)


@contextlib.contextmanager
def count_saved(exclude: set[int]) -> Iterator[SavedBytes]:
    """Count the unique storages saved for backward (not those in `exclude`) while the
    context is open.

    Args:
        exclude: `storage_key` values not to count (parameters, buffers).

    Yields:
        The `SavedBytes` that the pack hook fills.
    """
    saved = SavedBytes(exclude)
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
        yield saved


@dataclass(frozen=True)
class FakeForward:
    """What one forward (and loss) on fake tensors showed.

    Attributes:
        saved_bytes: bytes saved for backward, each storage once, parameters and
            buffers excluded.
        grad_params: names of the parameters the graph reaches from the loss (or the
            output): those a backward gives a gradient.
    """

    saved_bytes: int
    grad_params: frozenset[str]


def fake_forward(
    model: nn.Module,
    inputs: torch.Tensor | Sequence[torch.Tensor],
    *,
    policy: Policy | str,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    targets: Any = None,
    device_type: str = "cpu",
) -> FakeForward:
    """Run one forward (and loss) under `policy` on fake tensors: what it saves, and
    which parameters get a gradient.

    The forward runs on fake tensors (`torch._subclasses.FakeTensorMode`): shapes
    and dtypes propagate, autocast decides op dtypes exactly as in a real run,
    and no memory is allocated. Parameters take the policy's storage dtypes (fp32
    islands included); the model itself is not changed.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    pol = preset(policy)
    islands = island_param_names(model, pol)
    args = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        params = {
            name: mode.from_tensor(p.detach())
            .to(_param_dtype_for(pol, islands, name) if p.is_floating_point() else p.dtype)
            .requires_grad_(p.requires_grad)
            for name, p in model.named_parameters()
        }
        buffers = {name: mode.from_tensor(b) for name, b in model.named_buffers()}
        fake_args = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)
        fake_targets = mode.from_tensor(targets) if isinstance(targets, torch.Tensor) else targets
        exclude = {storage_key(t) for t in (*params.values(), *buffers.values())}
        autocast: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        if pol.compute_dtype is not None:
            autocast = torch.autocast(device_type=device_type, dtype=pol.compute_dtype)
        with (
            temporary_fp32_islands(model, pol, device_type),
            count_saved(exclude) as saved,
            autocast,
        ):
            out = torch.func.functional_call(model, {**params, **buffers}, fake_args)
            if loss_fn is not None:
                out = loss_fn(out, fake_targets)
        reached = _leaves_reached(_tensors_in(out))
        names = frozenset(n for n, p in params.items() if id(p) in reached)
        return FakeForward(saved_bytes=saved.peak, grad_params=names)


def saved_activation_bytes(
    model: nn.Module,
    inputs: torch.Tensor | Sequence[torch.Tensor],
    *,
    policy: Policy | str,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    targets: Any = None,
    device_type: str = "cpu",
) -> int:
    """Predict the bytes saved for backward by one forward (and loss) under `policy`
    (`fake_forward`'s `saved_bytes`: no memory used, the model not changed)."""
    return fake_forward(
        model, inputs, policy=policy, loss_fn=loss_fn, targets=targets, device_type=device_type
    ).saved_bytes


def _tensors_in(out: Any) -> list[torch.Tensor]:
    """The tensors in a model's output (a tensor, a mapping such as transformers'
    ``ModelOutput``, or a list or tuple of them)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, Mapping):
        return [t for v in out.values() for t in _tensors_in(v)]
    if isinstance(out, list | tuple):
        return [t for v in out for t in _tensors_in(v)]
    return []


def _leaves_reached(outputs: list[torch.Tensor]) -> set[int]:
    """``id`` of every leaf tensor the autograd graph of `outputs` accumulates into."""
    seen: dict[int, Any] = {}  # holds the nodes, so that no id is reused meanwhile
    leaves: set[int] = set()
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen[id(node)] = node
        variable = getattr(node, "variable", None)  # an AccumulateGrad node
        if isinstance(variable, torch.Tensor):
            leaves.add(id(variable))
        stack.extend(f for f, _ in node.next_functions if f is not None)
    return leaves


def _param_dtype_for(policy: Policy, islands: set[str], name: str) -> torch.dtype:
    return torch.float32 if name in islands else policy.param_dtype
