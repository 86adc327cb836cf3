"""The components of a memory breakdown, and which component a parameter belongs to.

Components (bytes):

* ``params``: parameter storage in the policy's storage dtype (fp32 islands apart);
* ``fp32_islands``: parameters of modules kept in fp32 (norm layers by default);
* ``grads``: gradients, in the dtype of their parameter;
* ``master``: the optimizer's full-precision representation of 16-bit params
  (fp32 copy, int16/int8 remainders, Kahan compensation);
* ``moments``: optimizer moments, including int8 block scales;
* ``activations``: tensors saved for backward (autocast's 16-bit weight copies
  included, parameters themselves excluded).

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
    "MemoryBreakdown",
    "Sharding",
    "format_gib",
]

Sharding = Literal["none", "fsdp", "ddp"]

#: The components, in report order.
COMPONENTS: tuple[str, ...] = (
    "params",
    "fp32_islands",
    "grads",
    "master",
    "moments",
    "activations",
)

_GiB = 2.0**30


@dataclass(frozen=True, kw_only=True)
class Components:
    """Bytes by component; `total` is their sum."""

    params: int = 0
    fp32_islands: int = 0
    grads: int = 0
    master: int = 0
    moments: int = 0
    activations: int = 0

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
class MemoryBreakdown:
    """Predicted or measured memory of one policy, and its communication per step.

    Attributes:
        policy: the policy name.
        params: the number of parameters.
        world_size: ranks the model is spread over.
        sharding: ``none``, ``fsdp`` (FSDP2: params, grads, master and moments
            sharded) or ``ddp`` (replicated).
        bytes: bytes by component over all ranks together (`per_rank` times
            `world_size`; with FSDP2 that is the whole model once, padding included).
        per_rank: bytes one rank holds.
        comm_bytes_per_step: logical payload per step: ``all_gather`` (FSDP2
            parameter all-gathers in the compute dtype, forward and backward),
            ``reduce_scatter`` (FSDP2 gradients in the reduce dtype),
            ``all_reduce`` (DDP gradients in the reduce dtype).
        measured: True for `measure` output, False for `estimate`.
        notes: assumptions worth reading next to the numbers.
    """

    policy: str
    params: int
    world_size: int = 1
    sharding: Sharding = "none"
    bytes: Components
    per_rank: Components
    comm_bytes_per_step: Mapping[str, int] = field(default_factory=dict)
    measured: bool = False
    notes: tuple[str, ...] = ()

    @property
    def state_bytes_per_param(self) -> float:
        """Training-state bytes (everything but activations) per parameter, on one rank
        times the world size for sharded state (i.e. of the whole model once)."""
        per_rank_state = self.per_rank.total - self.per_rank.activations
        copies = self.world_size if self.sharding == "fsdp" else 1
        return per_rank_state * copies / self.params if self.params else 0.0

    def to_dict(self) -> dict[str, Any]:
        """The JSON contract of `mixprec budget --json` (one object per policy)."""
        return {
            "policy": self.policy,
            "params": self.params,
            "world_size": self.world_size,
            "sharding": self.sharding,
            "bytes": self.bytes.to_dict(),
            "per_rank": self.per_rank.to_dict(),
            "comm_bytes_per_step": dict(self.comm_bytes_per_step),
            "measured": self.measured,
            "notes": list(self.notes),
        }


def format_gib(n: float) -> str:
    """Bytes as GiB with two decimals."""
    return f"{n / _GiB:.2f}"
