"""Measurement of real tensors: memory by component on a real step, optimizer state by category.

Every byte is counted once per storage: tensors that share memory (tied weights,
views) count once, a DTensor counts its local shard, and a wrapper tensor
subclass (torchao's quantized optimizer states) counts the plain tensors it is
made of. This module is the one place that measures optimizer state;
`mixprec.memory.state_layout` is the analytic witness it is compared against.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from mixprec.engine.fp8 import is_float8_linear
from mixprec.formats import master_state_keys, moment_specs, moment_state_keys
from mixprec.islands import island_param_names
from mixprec.memory.activations import count_saved, storage_key
from mixprec.memory.breakdown import Components, Fp8Memory, MemoryBreakdown
from mixprec.memory.fp8 import fp8_transient_windows, measured_transients
from mixprec.optim.rules import RULES
from mixprec.policy import Policy, preset

__all__ = [
    "MASTER_STATE_KEYS",
    "MOMENT_STATE_KEYS",
    "measure",
    "optimizer_state_bytes",
    "optimizer_state_nbytes",
    "training_state_bytes",
]

#: State keys holding master-weight information (from the format registry).
MASTER_STATE_KEYS: frozenset[str] = master_state_keys()


def _moment_keys() -> frozenset[str]:
    """State keys holding moments: those of every rule's slots (`RULES`) in every
    registered moment format (``max_exp_avg_sq_u8``, ``momentum_buffer_i8``, ...), and
    torch's own optimizers' names (`mixprec.formats.registry.TORCH_MOMENT_KEYS`)."""
    slots = {slot for rule in RULES.values() for slot in rule.slots}
    keys = {t.name for spec in moment_specs() for t in spec.state_for(tuple(slots))}
    return moment_state_keys() | keys


#: State keys holding moments (`_moment_keys`, as the formats registered at import).
MOMENT_STATE_KEYS: frozenset[str] = _moment_keys()


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)  # DTensor shards count their local part
    return to_local() if callable(to_local) else t


def _storage_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    # Wrapper subclasses (torchao's quantized optimizer states) have no storage
    # of their own: count the plain tensors they are made of.
    flatten = getattr(t, "__tensor_flatten__", None)
    if not callable(flatten):
        return [t]
    names, _ = flatten()
    return [inner for name in names for inner in _storage_tensors(getattr(t, name))]


class _Counter:
    """Bytes of tensors, each storage counted once over the counter's life."""

    def __init__(self) -> None:
        self.seen: set[tuple[str, int]] = set()

    def bytes_of(self, tensors: Iterable[object]) -> int:
        total = 0
        for obj in tensors:
            if not isinstance(obj, torch.Tensor):
                continue
            for t in _storage_tensors(_local(obj)):
                storage = t.untyped_storage()
                key = (str(t.device), storage.data_ptr())
                if key in self.seen or storage.nbytes() == 0:
                    continue
                self.seen.add(key)
                total += storage.nbytes()
        return total


def _state_bytes(optimizer: torch.optim.Optimizer, counter: _Counter) -> dict[str, int]:
    # The keys are read at call time: formats may be registered later.
    masters, moments = master_state_keys(), _moment_keys()
    out = {"master": 0, "moments": 0, "other": 0}
    # A wrapper (`mixprec.optim.Mastered`) holds the masters; the torch optimizer it
    # steps (its ``inner``) holds that optimizer's own state.
    inner = getattr(optimizer, "inner", None)
    states = list(optimizer.state.values())
    if isinstance(inner, torch.optim.Optimizer) and inner is not optimizer:
        states += list(inner.state.values())
    for state in states:
        for key, value in state.items():
            category = "master" if key in masters else "moments" if key in moments else "other"
            out[category] += counter.bytes_of([value])
    return out


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of optimizer state by category, each storage counted once.

    Works for any `torch.optim.Optimizer`: keys in `MASTER_STATE_KEYS` are
    ``master``, keys in `MOMENT_STATE_KEYS` are ``moments``, and everything else
    (step counters, RNG state, unknown keys) is ``other``. An optimizer with an
    ``inner`` optimizer (``mixprec.optim.Mastered``) counts the inner one's state too.

    Returns:
        ``{"master": ..., "moments": ..., "other": ..., "total": ...}``.
    """
    out = _state_bytes(optimizer, _Counter())
    out["total"] = sum(out.values())
    return out


#: The same measurement under its earlier `mixprec.memory` name.
optimizer_state_nbytes = optimizer_state_bytes


def training_state_bytes(optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Persistent bytes of params, grads and optimizer state, each storage counted once.

    This rank's bytes: DTensors (FSDP2 shards) count their local storage.

    Returns:
        ``{"params", "grads", "master", "moments", "other", "total"}`` in bytes.
    """
    counter = _Counter()
    params = [p for g in optimizer.param_groups for p in g["params"]]
    out = {
        "params": counter.bytes_of(params),
        "grads": counter.bytes_of(p.grad for p in params if p.grad is not None),
    }
    out.update(_state_bytes(optimizer, counter))
    out["total"] = sum(out.values())
    return out


def measure(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    step_fn: Callable[[], Any],
    *,
    policy: Policy | str | None = None,
) -> MemoryBreakdown:
    """Measure the components on one real training step, as this process holds them.

    Under FSDP2 that is this rank's share: a DTensor parameter, gradient or state
    tensor counts its local shard's storage (padding included where FSDP2 pads).

    `step_fn` runs one full step (forward, loss, backward, optimizer step). During
    it, tensors saved for backward are recorded (unique storages, parameters and
    buffers excluded) and each gradient's size is taken as it is accumulated, so
    `zero_grad` inside `step_fn` does not hide them. Afterwards parameters, buffers
    and optimizer state (`optimizer_state_bytes`) are walked (unique storages). On
    CUDA the peak allocated memory of the step is added to the notes.

    A model with torchao ``Float8Linear`` layers (an FP8 policy, prepared) also gets
    ``fp8_cast_temporaries``: the most memory one such layer allocates and frees again
    within its forward or its backward, recorded by a dispatch mode on only inside
    those layers (`mixprec.memory.fp8.fp8_transient_windows`); `MemoryBreakdown.fp8`
    holds the forward and backward figures and the layer.

    Args:
        model: the prepared model.
        optimizer: its optimizer (state is created lazily at the first step, so
            measure a step, not before it).
        step_fn: runs one training step.
        policy: the policy in force (for island classification and the name);
            default: infer nothing about islands and name it ``measured``.
    """
    pol = preset(policy) if policy is not None else None
    params = [(n, p) for n, p in model.named_parameters()]
    param_keys = {storage_key(_local(p)) for _, p in params}
    param_keys |= {storage_key(_local(b)) for b in model.buffers()}
    grad_sizes: dict[int, int] = {}
    handles = []
    for _, p in params:
        if p.requires_grad:

            def hook(t: torch.Tensor) -> None:
                if t.grad is not None:  # a DTensor gradient: its local shard's storage
                    g = _local(t.grad)
                    grad_sizes[storage_key(g)] = g.untyped_storage().nbytes()

            handles.append(p.register_post_accumulate_grad_hook(hook))  # type: ignore[no-untyped-call]
    released: list[int] = [0]  # under gradient release: the largest gradient seen
    if pol is not None and pol.release_gradients:
        for _, p in params:
            if p.requires_grad:

                def seen(g: torch.Tensor) -> None:
                    released[0] = max(released[0], _local(g).untyped_storage().nbytes())

                handles.append(p.register_hook(seen))  # type: ignore[no-untyped-call]
    cuda = any(p.is_cuda for _, p in params)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    try:
        with count_saved(param_keys) as saved, fp8_transient_windows(model) as windows:
            step_fn()
    finally:
        for h in handles:
            h.remove()
    islands = island_param_names(model, pol) if pol is not None else set()
    counter = _Counter()
    params_bytes = islands_bytes = 0
    for name, p in params:
        size = counter.bytes_of([p])
        if name in islands:
            islands_bytes += size
        else:
            params_bytes += size
    buffers_bytes = counter.bytes_of(model.buffers())
    state = optimizer_state_bytes(optimizer)
    fwd, bwd, where = measured_transients(windows)
    fp8 = _fp8_memory(model, fwd, bwd, where, pol)
    comps = Components(
        params=params_bytes,
        fp32_islands=islands_bytes,
        buffers=buffers_bytes,
        grads=sum(grad_sizes.values()),
        released_grads=released[0],
        master=state["master"],
        moments=state["moments"],
        activations=saved.peak,
        fp8_cast_temporaries=max(fwd or 0, bwd or 0),
    )
    notes = [f"optimizer other state: {state['other']} bytes (step counters, RNG)"]
    if cuda:
        notes.append(
            f"CUDA peak allocated during the step: {torch.cuda.max_memory_allocated()} bytes"
        )
    return MemoryBreakdown(
        policy=pol.name if pol is not None else "measured",
        params=sum(p.numel() for _, p in params),
        bytes=comps,
        per_rank=comps,
        measured=True,
        notes=tuple(notes),
        fp8=fp8,
    )


def _fp8_memory(
    model: nn.Module, fwd: int | None, bwd: int | None, where: str | None, pol: Policy | None
) -> Fp8Memory | None:
    """The measured `Fp8Memory` of a model with ``Float8Linear`` layers (else None)."""
    layers = [m for m in model.modules() if is_float8_linear(m)]
    if not layers and (pol is None or pol.fp8 is None):
        return None
    config = getattr(layers[0], "config", None) if layers else None
    emulate = bool(getattr(config, "emulate", True))
    recipe = pol.fp8.recipe if pol is not None and pol.fp8 is not None else "unknown"
    return Fp8Memory(
        recipe=recipe,
        emulate=emulate,
        emulate_reason="as the converted layers run" if layers else "no layer converted",
        converted=len(layers),
        forward=fwd if layers else 0,
        backward=bwd if layers else 0,
        layer=where,
        estimated=True,
    )
