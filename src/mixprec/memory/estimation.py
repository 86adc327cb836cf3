"""The analytic estimate: memory by component and communication per step for a policy.

"Half the memory" claims fail because they count activations and forget masters,
moments, gradients and communication. `estimate` predicts every component (see
`mixprec.memory.breakdown`) for a module, a `TransformerShape` or a bare
parameter count, without allocating the model's memory; `mixprec.memory.measure`
measures the same components on a real step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn

from mixprec.dtypes import dtype_name
from mixprec.islands import island_param_names
from mixprec.memory.activations import fake_forward, storage_key
from mixprec.memory.breakdown import Components, Fp8Memory, MemoryBreakdown, Sharding
from mixprec.memory.fp8 import (
    Fp8Layer,
    fp8_layers,
    layer_transients,
    refuse_converted,
    resolve_emulate,
    transformer_fp8_layers,
)
from mixprec.memory.optimizer_rule import optimizer_rule
from mixprec.memory.state_layout import int8_eligible, state_nbytes
from mixprec.memory.transformer import TransformerShape
from mixprec.optim.rules import RULES
from mixprec.optim.sharding import dim0_row_counts
from mixprec.policy import Policy, preset

__all__ = ["estimate"]


def _nbytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class _Tensor:
    """What the estimate knows about one parameter (or an aggregate of many)."""

    numel: int
    shape: tuple[int, ...]  # FSDP2 shards dim 0; an aggregate is one long row of rows
    island: bool
    aggregate: bool = False  # a count standing for many large tensors
    trainable: bool = True  # gets a gradient: frozen or unreached ones are only stored


def _storage(t: _Tensor, pol: Policy, numel: int) -> Components:
    size = numel * _nbytes(torch.float32 if t.island else pol.param_dtype)
    grads = size if t.trainable else 0
    if t.island:
        return Components(fp32_islands=size, grads=grads)
    # The fp32 sums of a step's micro-batches (mixprec.engine.accumulation), 16-bit only.
    summed = t.trainable and pol.grad_accum_dtype is not None and pol.param_dtype != torch.float32
    accum = numel * _nbytes(pol.grad_accum_dtype or torch.float32) if summed else 0
    return Components(params=size, grads=grads, grad_accum=accum)


#: The moments an update rule keeps: ``(state key, kind)`` pairs (`Rule.slots`).
Slots = tuple[tuple[str, str], ...]


def _state(t: _Tensor, pol: Policy, numel: int, *, int8: bool, slots: Slots) -> Components:
    if not t.trainable:  # optimizers make state at a parameter's first step: never here
        return Components()
    dtype = torch.float32 if t.island else pol.param_dtype
    master = "none" if dtype == torch.float32 else pol.master
    st = state_nbytes(
        numel,
        param_dtype=dtype,
        master=master,
        moments=pol.moments,
        quantizable=int8,
        slots=slots,
        shape=None if t.aggregate or numel != t.numel else t.shape,
    )
    return Components(master=st["master"], moments=st["moments"])


def _tensor_bytes(
    t: _Tensor, pol: Policy, world_size: int, sharded: bool, slots: Slots
) -> tuple[Components, Components]:
    """(rank 0's bytes, the sum over ranks) of one tensor's params, grads and state.

    Under FSDP2 each rank holds ``torch.chunk``'s share of dim 0: rank 0 the most,
    ``ceil(rows / W)`` rows. Parameter storage and the reduce-scatter output that
    holds the sharded gradients are padded to rank 0's rows on every rank
    (`fully_shard` pads dim 0); the optimizer allocates state from each rank's
    unpadded local shard, and int8 moments are kept only when every shard holds
    whole blocks (the optimizer's rule, `int8_eligible`).
    """
    if not sharded:
        one = _storage(t, pol, t.numel) + _state(
            t, pol, t.numel, int8=t.aggregate or int8_eligible(t.shape), slots=slots
        )
        return one, _times(one, world_size)
    rows = t.shape[0] if t.shape else 1
    row = t.numel // rows if rows else 0
    int8 = t.aggregate or int8_eligible(t.shape, parts=world_size)
    shares = dim0_row_counts(rows, world_size)  # rank 0 holds the most
    storage = _storage(t, pol, max(shares) * row)
    rank0 = storage + _state(t, pol, max(shares) * row, int8=int8, slots=slots)
    total = _times(storage, world_size)
    for share, ranks in shares.items():
        total = total + _times(_state(t, pol, share * row, int8=int8, slots=slots), ranks)
    return rank0, total


def estimate(
    model: nn.Module | int | float | TransformerShape,
    policy: Policy | str,
    *,
    world_size: int = 1,
    sharding: Sharding = "fsdp",
    inputs: torch.Tensor | Sequence[torch.Tensor] | None = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    targets: Any = None,
    activation_values: float | None = None,
    device_type: str = "cpu",
    optimizer: str = "adamw",
    optimizer_args: Mapping[str, Any] | None = None,
) -> MemoryBreakdown:
    """Predict memory by component and communication per step for `policy`.

    Args:
        model: an `nn.Module` (exact per-tensor figures), a parameter count, or a
            `TransformerShape` (parameters and activations from the config).
        policy: a `Policy` or preset name.
        world_size: ranks. ``per_rank`` is what rank 0 holds, ``bytes`` the sum
            over all ranks; each rank runs its own micro-batch of activations.
        sharding: ``fsdp`` (FSDP2 / ZeRO-3: params, grads, master and moments
            sharded along dim 0 of each tensor as ``torch.chunk`` splits it, so
            rank 0 holds the largest share), ``ddp`` (every rank holds them
            whole), or ``none`` (one rank).
        inputs, loss_fn, targets: an example micro-batch for a module: activations
            are then predicted by a fake-tensor forward (no memory used), which also
            shows which trainable parameters get a gradient (without it, all do).
        activation_values: for a parameter count, the number of activation values
            saved for backward; bytes follow the compute dtype (fp32 without autocast).
        device_type: the device type autocast would run on; under an FP8 policy it
            also picks the GEMM path the cast temporaries are replayed for (emulated
            on every device but ``cuda``; see `mixprec.memory.fp8.resolve_emulate`).
        optimizer, optimizer_args: the `mixprec.optim` optimizer the run steps with
            (``adamw``, ``adam``, ``sgd``, ``lion``) and its keyword arguments: they
            pick its update rule, whose moments (`mixprec.optim.rules.Rule.slots`:
            two for AdamW, three with ``amsgrad``, one for SGD with ``momentum`` and for
            Lion, none for plain SGD) are counted in the policy's moment format
            (`mixprec.memory.optimizer_rule`). `MemoryBreakdown.rule` names it.

    Under ``Policy.grad_accum_dtype=torch.float32`` ``grad_accum`` counts the fp32 sums
    of the 16-bit parameters' gradients that a step accumulating several micro-batches
    holds (`mixprec.engine.accumulation`); a step of one micro-batch holds none.

    Under an FP8 policy (`Policy.fp8`) the training state is the 16-bit policy's, the
    activations are a 16-bit linear's (torchao saves the high-precision input and
    weight), and ``fp8_cast_temporaries`` is the largest transient of one converted
    layer (the engine's own layer choice), known from a module with inputs or a
    `TransformerShape`; `MemoryBreakdown.fp8` says which path and which layer.

    Raises:
        ValueError: a bad `world_size` or `sharding`; ``grad_accum_dtype`` under FSDP2;
            an unknown `optimizer`, or arguments it refuses.
        PrecisionError: a module an FP8 policy's `Precision.prepare` converted, with a
            policy `prepare` would refuse on it (one without fp8, or another recipe).
    """
    pol = preset(policy)
    rule = optimizer_rule(optimizer, optimizer_args)
    slots = RULES[rule].slots
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if sharding not in ("none", "fsdp", "ddp"):
        raise ValueError(f"sharding must be one of none, fsdp, ddp; got {sharding!r}")
    if world_size > 1 and sharding == "none":
        raise ValueError("world_size > 1 needs sharding='fsdp' or 'ddp'")
    notes: list[str] = []
    compute_bytes = _nbytes(pol.effective_compute_dtype)
    tensors: list[_Tensor]
    act_rank = buffer_bytes = 0
    act_known = isinstance(model, nn.Module | TransformerShape)  # a module: with inputs
    if isinstance(model, nn.Module):
        refuse_converted(model, pol, device_type)
        islands = island_param_names(model, pol)
        named = list(model.named_parameters())  # tied ones once: named_parameters skips repeats
        with fp8_layers(model, pol) as layers:
            step = None
            if inputs is not None:
                step = fake_forward(
                    model,
                    inputs,
                    policy=pol,
                    loss_fn=loss_fn,
                    targets=targets,
                    device_type=device_type,
                )
                act_rank = step.saved_bytes
        fp8 = _fp8_memory(pol, layers, device_type, converted=len(layers), notes=notes)
        # Every parameter is stored; frozen ones, and (known from a forward) those its
        # graph does not reach, get no gradient and no optimizer state, as in a real step.
        tensors = [
            _Tensor(
                p.numel(),
                tuple(p.shape),
                name in islands,
                False,
                p.requires_grad and (step is None or name in step.grad_params),
            )
            for name, p in named
        ]
        frozen = sum(p.numel() for _, p in named if not p.requires_grad)
        if frozen:
            notes.append(f"{frozen:,} frozen parameters: stored, no gradients or optimizer state")
        unused = [
            n
            for (n, p), t in zip(named, tensors, strict=True)
            if p.requires_grad and not t.trainable
        ]
        if unused:
            notes.append(
                f"{len(unused)} trainable parameter(s) the forward does not reach ({unused[0]}"
                f"{', ...' if len(unused) > 1 else ''}): no gradient, so no optimizer state"
            )
        buffer_storages = {storage_key(b): b.untyped_storage().nbytes() for b in model.buffers()}
        buffer_bytes = sum(buffer_storages.values())
        if inputs is None and activation_values is None:
            act_known = False
            notes.append(
                "activations not estimated, and every trainable parameter assumed to get a "
                "gradient: pass inputs= (and loss_fn=) to include them"
            )
    elif isinstance(model, TransformerShape):
        fp8 = _fp8_memory(pol, transformer_fp8_layers(model, pol), device_type, notes=notes)
        matrices, norms = model.param_counts()
        tensors = [
            _Tensor(matrices, (matrices,), False, aggregate=True),
            _Tensor(norms, (norms,), pol.param_dtype != torch.float32),
        ]
        compute_values, fp32_values = model.activation_values()
        act_rank = compute_values * compute_bytes + fp32_values * 4
        notes.append(
            "transformer parameters are counted as one large tensor per kind; activations assume "
            "fused attention and no dropout"
        )
    else:
        n = int(model)
        if n < 0 or n != model:
            raise ValueError(f"a parameter count must be a non-negative integer, got {model!r}")
        tensors = [_Tensor(n, (n,), False, aggregate=True)]
        notes.append("a bare parameter count: no fp32 islands, every tensor large")
        fp8 = _fp8_memory(pol, None, device_type, notes=notes)
    if activation_values is not None:
        act_rank = round(activation_values) * compute_bytes
        act_known = True
    if not act_known and not isinstance(model, nn.Module):
        notes.append("activations not estimated: pass activation_values= to include them")
    n_params = sum(t.numel for t in tensors)
    sharded = sharding == "fsdp" and world_size > 1
    if sharded and pol.grad_accum_dtype is not None and pol.param_dtype != torch.float32:
        raise ValueError(
            f"policy {pol.name!r}: grad_accum_dtype={dtype_name(pol.grad_accum_dtype)} is refused "
            "under FSDP2, which accumulates sharded gradients itself (Precision.prepare refuses "
            "it); fix: sharding='ddp', or drop grad_accum_dtype (FSDP2 sums unsharded gradients "
            "in its fp32 reduce_dtype when all but the last micro-batch skip the reduction)"
        )

    # Rank 0's bytes (the largest share under FSDP2; every rank's under DDP) and
    # the sum over all ranks; each rank runs its own micro-batch.
    casts = fp8.peak if fp8 is not None else 0
    rank0 = Components(buffers=buffer_bytes, activations=act_rank, fp8_cast_temporaries=casts)
    whole = _times(rank0, world_size)  # buffers are not sharded: every rank holds them
    for t in tensors:
        one, every = _tensor_bytes(t, pol, world_size, sharded, slots)
        rank0, whole = rank0 + one, whole + every

    if pol.release_gradients:
        largest = model.largest_matrix() if isinstance(model, TransformerShape) else None
        rank0, whole = _released(tensors, pol, rank0, whole, world_size, notes, largest)

    # Each rank's collective buffers per step (the sum over ranks is W times this).
    comm: dict[str, int] = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
    if world_size > 1:
        reduce_bytes = _nbytes(pol.reduce_dtype)
        gather_dtype = pol.compute_dtype or pol.param_dtype
        for t in tensors:
            numel = t.numel
            if sharded:  # padded: W times rank 0's share
                rows = t.shape[0] if t.shape else 1
                numel = max(dim0_row_counts(rows, world_size)) * (t.numel // rows if rows else 0)
                numel *= world_size
            if sharded:
                gather = numel * (4 if t.island else _nbytes(gather_dtype))
                comm["all_gather"] += 2 * gather  # forward, and again for backward
                comm["reduce_scatter"] += numel * reduce_bytes if t.trainable else 0
            elif t.trainable:
                comm["all_reduce"] += numel * reduce_bytes
        if sharded:
            notes.append("FSDP2 re-gathers parameters for backward (reshard_after_forward=True)")
        else:
            notes.append(
                "DDP also keeps gradient buckets as large as the grads (not counted; "
                "gradient_as_bucket_view=True shares them)"
            )
    return MemoryBreakdown(
        policy=pol.name,
        params=n_params,
        world_size=world_size,
        sharding=sharding if world_size > 1 else "none",
        bytes=whole,
        per_rank=rank0,
        comm_bytes_per_step=comm,
        measured=False,
        activations_estimated=act_known,
        notes=tuple(notes),
        fp8=fp8,
        rule=rule,
    )


def _fp8_memory(
    pol: Policy,
    layers: list[Fp8Layer] | None,
    device_type: str,
    *,
    converted: int | None = None,
    notes: list[str],
) -> Fp8Memory | None:
    """What the policy's FP8 linears add: `layers` None when no shape is known (a bare
    count); a layer with ``tokens`` None saw no forward (a module without inputs)."""
    settings = pol.fp8
    if settings is None:
        return None
    emulate, why = resolve_emulate(settings, device_type)
    path = "emulated GEMMs" if emulate else "FP8 GEMM units"
    notes.append(
        f"fp8 {settings.recipe}: training state and activations as the 16-bit policy's "
        "(torchao saves the 16-bit input and weight for backward); cast temporaries for "
        f"{path} ({why}), eager (torch.compile fuses the casts: less)"
    )
    if layers is not None and not layers:  # nothing converts: known to be nothing
        notes.append(f"fp8 {settings.recipe}: no linear layer converts: no FP8 memory")
        return Fp8Memory(
            recipe=settings.recipe, emulate=emulate, emulate_reason=why, converted=converted,
            forward=0, backward=0,
        )  # fmt: skip
    fwd, bwd, where = layer_transients(layers or [], settings.recipe, emulate=emulate)
    if fwd is None:
        count = f" ({converted} linear layer(s) convert)" if converted is not None else ""
        notes.append(
            f"fp8 cast temporaries not estimated{count}: they scale with the converted layers' "
            "shapes and tokens per micro-batch; fix: in Python, mixprec.memory.estimate(model, "
            "policy, inputs=..., loss_fn=...); from the CLI, mixprec budget --config "
            "CONFIG.json --seq-len N --micro-batch B (a transformer's config)"
        )
    return Fp8Memory(
        recipe=settings.recipe, emulate=emulate, emulate_reason=why, converted=converted,
        forward=fwd, backward=bwd, layer=where, estimated=fwd is not None,
    )  # fmt: skip


def _released(
    tensors: list[_Tensor],
    pol: Policy,
    rank0: Components,
    whole: Components,
    world_size: int,
    notes: list[str],
    largest_matrix: int | None,
) -> tuple[Components, Components]:
    """Gradient release (`Policy.release_gradients`): no gradient is held between backward
    and the step; during backward, the largest one at most (`released_grads`; a
    transformer config's largest matrix, `largest_matrix` elements, stands for its
    aggregated matrices)."""
    if world_size > 1:
        raise ValueError(
            f"policy {pol.name!r} releases gradients, which runs in one process (DDP and "
            "FSDP2 reduce gradients after the hook that would step them): world_size=1, or a "
            "policy without release_gradients"
        )
    sizes = [
        t.numel * _nbytes(torch.float32 if t.island else pol.param_dtype)
        for t in tensors
        if t.trainable and not t.aggregate
    ]
    if largest_matrix is not None:
        sizes.append(largest_matrix * _nbytes(pol.param_dtype))
    elif len(sizes) < sum(t.trainable for t in tensors):
        notes.append(
            "gradients released: the largest one, held during backward, is unknown from a "
            "count (released_grads counts the known tensors only)"
        )
    largest = max(sizes, default=0)
    rank0 = dataclasses.replace(rank0, grads=0, released_grads=largest)
    return rank0, dataclasses.replace(whole, grads=0, released_grads=largest)


def _times(c: Components, k: int) -> Components:
    return Components(**{f.name: getattr(c, f.name) * k for f in fields(c)})
