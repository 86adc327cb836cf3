"""The components of a memory breakdown, and which component a parameter belongs to.

Components (bytes):

* ``params``: parameter storage in the policy's storage dtype (fp32 islands apart);
* ``fp32_islands``: parameters of modules kept in fp32 (norm layers by default);
* ``buffers``: the module's buffers (persistent or not: running statistics, rotary
  caches) as they are held, each storage once; a buffer a forward saves for
  backward is counted here, not in ``activations``;
* ``grads``: gradients, in the dtype of their parameter;
* ``grad_accum``: under ``Policy.grad_accum_dtype=torch.float32``, the fp32 sums of
  the gradients of 16-bit parameters held while a step accumulates micro-batches
  (from the second backward to the step); 0 otherwise;
* ``released_grads``: under ``Policy.release_gradients``, the most gradient bytes
  held at once during backward (the largest parameter's gradient: each is freed as
  soon as its parameter is stepped, so ``grads``, held between backward and the
  step, is 0); 0 otherwise;
* ``master``: the optimizer's full-precision representation of 16-bit params
  (fp32 copy, int16/int8 remainders, Kahan compensation);
* ``moments``: optimizer moments, including int8 block scales;
* ``activations``: tensors saved for backward (autocast's 16-bit weight copies
  included, parameters themselves excluded);
* ``fp8_cast_temporaries``: under an FP8 policy, the most memory one converted
  layer's casts and FP8 GEMMs allocate and free again within its forward or its
  backward (`mixprec.memory.fp8`); 0 without FP8.

`estimate` (predicted) and `measure` (walked on a real step) both answer with a
`MemoryBreakdown` of these components, so the two can be compared field by field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal

__all__ = [
    "COMPONENTS",
    "Components",
    "Fp8Memory",
    "MemoryBreakdown",
    "Sharding",
    "format_bytes",
]

Sharding = Literal["none", "fsdp", "ddp"]

#: The components, in report order.
COMPONENTS: tuple[str, ...] = (
    "params",
    "fp32_islands",
    "buffers",
    "grads",
    "grad_accum",
    "released_grads",
    "master",
    "moments",
    "activations",
    "fp8_cast_temporaries",
)

_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


@dataclass(frozen=True, kw_only=True)
class Components:
    """Bytes by component; `total` is their sum."""

    params: int = 0
    fp32_islands: int = 0
    buffers: int = 0
    grads: int = 0
    grad_accum: int = 0
    released_grads: int = 0
    master: int = 0
    moments: int = 0
    activations: int = 0
    fp8_cast_temporaries: int = 0

    @property
    def total(self) -> int:
        """The sum of every component."""
        return sum(getattr(self, f.name) for f in fields(self))

    def to_dict(self) -> dict[str, int]:
        """Every component and the total."""
        out = {f.name: int(getattr(self, f.name)) for f in fields(self)}
        out["total"] = self.total
        return out

    def __add__(self, other: Components) -> Components:
        return Components(
            **{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)}
        )


@dataclass(frozen=True, kw_only=True)
class Fp8Memory:
    """What FP8 linear layers add to a step, per rank (`MemoryBreakdown.fp8`).

    Attributes:
        recipe: torchao's recipe name.
        emulate: whether the figures are for emulated GEMMs (fp32 dequantized operands:
            every CPU) or for FP8 units (``torch._scaled_mm``, CUDA sm_89+).
        emulate_reason: why, in one phrase.
        converted: layers that run as ``Float8Linear`` (None: unknown without a module).
        forward: the largest forward transient of one converted layer, in bytes (None:
            not estimated: it needs the layers' shapes and tokens per micro-batch).
        backward: the same for backward.
        layer: the layer with the largest transient (a qualified name, or a shape
            such as ``"768x3072"`` for a `TransformerShape`).
        estimated: False when nothing said how large the layers' inputs are.
    """

    recipe: str
    emulate: bool
    emulate_reason: str
    converted: int | None = None
    forward: int | None = None
    backward: int | None = None
    layer: str | None = None
    estimated: bool = True

    @property
    def peak(self) -> int:
        """``fp8_cast_temporaries``: the larger of `forward` and `backward` (0 unknown)."""
        return max(self.forward or 0, self.backward or 0)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True, kw_only=True)
class MemoryBreakdown:
    """Predicted or measured memory of one policy, and its communication per step.

    Attributes:
        policy: the policy name.
        params: the number of parameters.
        world_size: ranks the model is spread over.
        sharding: ``none``, ``fsdp`` (FSDP2: params, grads, master and moments
            sharded) or ``ddp`` (replicated).
        bytes: bytes by component summed over all ranks (also `all_ranks`):
            with DDP `world_size` copies, with FSDP2 the whole model once plus
            the padding of parameter and gradient shards; activations of every
            rank's micro-batch.
        per_rank: bytes rank 0 holds. With DDP every rank holds the same; with
            FSDP2 rank 0 holds the largest share (``torch.chunk`` gives the
            first ranks ``ceil(rows / W)`` rows of each tensor, the last fewer).
        comm_bytes_per_step: each rank's collective buffers per step:
            ``all_gather`` (FSDP2 parameter all-gathers in the compute dtype,
            forward and backward), ``reduce_scatter`` (FSDP2 gradients in the
            reduce dtype), ``all_reduce`` (DDP gradients in the reduce dtype);
            FSDP2's are padded as its shards are. A ring sends about
            ``(W-1)/W`` of an all-gather or reduce-scatter buffer per rank.
        measured: True for `measure` output, False for `estimate`.
        activations_estimated: False when nothing said how large activations
            are (a bare count without activation values, a module without
            inputs): ``activations`` is then 0, not a figure.
        notes: assumptions worth reading next to the numbers.
        fp8: under an FP8 policy, what its linear layers add (`Fp8Memory`); None
            without FP8.
        rule: the update rule whose state an estimate counts (``adamw``,
            ``sgd_momentum``, ``lion``, ...: `mixprec.optim.rules.RULES`, picked by
            the optimizer and its arguments); None for a measurement.
    """

    policy: str
    params: int
    world_size: int = 1
    sharding: Sharding = "none"
    bytes: Components
    per_rank: Components
    comm_bytes_per_step: Mapping[str, int] = field(default_factory=dict)
    measured: bool = False
    activations_estimated: bool = True
    notes: tuple[str, ...] = ()
    fp8: Fp8Memory | None = None
    rule: str | None = None

    @property
    def all_ranks(self) -> Components:
        """Bytes by component summed over all ranks (the `bytes` field)."""
        return self.bytes

    @property
    def comm_bytes_per_step_all_ranks(self) -> dict[str, int]:
        """`comm_bytes_per_step` summed over all ranks."""
        return {k: v * self.world_size for k, v in self.comm_bytes_per_step.items()}

    @property
    def state_bytes_per_param(self) -> float:
        """Training-state bytes (everything but buffers and what a step holds only for a
        while: activations, released gradients, FP8 cast temporaries) of one model
        replica per parameter: all ranks together under FSDP2 (padding included), one
        rank otherwise."""
        held = self.bytes if self.sharding == "fsdp" else self.per_rank
        transient = held.activations + held.released_grads + held.fp8_cast_temporaries
        state = held.total - held.buffers - transient
        return state / self.params if self.params else 0.0

    def to_dict(self) -> dict[str, Any]:
        """The JSON contract of `mixprec budget --json` (one object per policy):
        ``per_rank`` is rank 0's bytes (``rank``), ``all_ranks`` their sum over ranks
        (``bytes`` is the same, under its earlier name)."""
        return {
            "policy": self.policy,
            "rule": self.rule,
            "params": self.params,
            "world_size": self.world_size,
            "sharding": self.sharding,
            "rank": 0,
            "per_rank": self.per_rank.to_dict(),
            "all_ranks": self.bytes.to_dict(),
            "bytes": self.bytes.to_dict(),
            "comm_bytes_per_step": dict(self.comm_bytes_per_step),
            "comm_bytes_per_step_all_ranks": self.comm_bytes_per_step_all_ranks,
            "activations_estimated": self.activations_estimated,
            "measured": self.measured,
            "notes": list(self.notes),
            "fp8": None if self.fp8 is None else self.fp8.to_dict(),
        }


def format_bytes(n: float) -> str:
    """Bytes in the largest binary unit that keeps the value at 1 or more, with three
    significant digits (``512 B``, ``3.91 KiB``, ``26.1 GiB``, ``104 GiB``)."""
    if abs(n) < 1024:
        return f"{n:.0f} B"
    value = float(n)
    for unit in _UNITS:
        value /= 1024
        if abs(value) < 1024 or unit == _UNITS[-1]:
            break
    decimals = 2 if abs(value) < 10 else 1 if abs(value) < 100 else 0
    return f"{value:.{decimals}f} {unit}"
