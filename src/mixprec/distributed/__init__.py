"""Data parallelism built from a precision policy: FSDP2 and DDP, PyTorch's engines.

* `shard(model, policy)` applies `fully_shard` per block and at the root with a
  `MixedPrecisionPolicy` built from the policy (`mixed_precision_policy`):
  parameters all-gathered in the compute dtype, gradients reduced in the
  policy's ``reduce_dtype``, outputs cast to its ``output_dtype``; fp32 islands
  get FSDP2 groups of their own, so they stay fp32.
* `ddp(model, policy)` wraps `DistributedDataParallel` with a communication hook
  that reduces in the policy's ``reduce_dtype`` (`reduce_in_dtype`) on gloo and
  NCCL alike.

`spawn` runs a command on several local ranks (what ``mixprec train --nproc N``
does). `process_group` joins the group that ``torchrun`` (or `spawn`) describes and
tears it down in the order that cannot hang at exit.

Both wrappers set the policy's storage first (what `Precision.prepare` does), so
``prec.prepare`` may be called before or after them. The step decision, the loss
scaler and the telemetry of `Precision` already agree across ranks (every
skip is decided on every rank together).

Example (under ``torchrun --nproc-per-node 2``)::

    def train(device):
        prec = mixprec.Precision("bf16_master")
        model = mixprec.distributed.shard(model, prec.policy)
        model = prec.prepare(model)
        optimizer = prec.optimizer(model, lr=3e-4)
        ...

    with mixprec.distributed.process_group("cpu") as device:
        train(device)  # the wrapped model is gone when the block ends
"""

from mixprec.distributed.data_parallel import ReduceHookState, ddp, reduce_in_dtype
from mixprec.distributed.fsdp import block_modules, mixed_precision_policy, shard
from mixprec.distributed.launch import process_group, rank, spawn, world_size

__all__ = [
    "ReduceHookState",
    "block_modules",
    "ddp",
    "mixed_precision_policy",
    "process_group",
    "rank",
    "reduce_in_dtype",
    "shard",
    "spawn",
    "world_size",
]
