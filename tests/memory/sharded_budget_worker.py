"""One rank of the sharded-budget test (run by test_sharded_budget.py, two gloo processes).

Usage: RANK=r WORLD_SIZE=2 MASTER_ADDR=... MASTER_PORT=... python sharded_budget_worker.py OUT
For each policy and each of FSDP2 (``fully_shard``) and DDP: prepare the model with
`mixprec.Precision`, wrap it, build the optimizer, run one step, and measure this
rank's bytes (`mixprec.memory.measure` and `training_state_bytes`). Every rank's
figures are gathered and rank 0 writes them to OUT as JSON.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).parent))
import sharded_model

import mixprec
from mixprec.distributed.launch import process_group
from mixprec.memory import measure, training_state_bytes

POLICIES = ("fp32", "bf16_master", "bf16_lean")


def shard(model: nn.Module, pol: mixprec.Policy) -> nn.Module:
    # FSDP2 needs one dtype per group: the fp32 norms (islands) get groups of their own.
    compute = None if pol.param_dtype == torch.float32 else pol.compute_dtype
    keep = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32)
    cast = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
    for m in model.modules():
        if isinstance(m, nn.LayerNorm):
            fully_shard(m, mp_policy=keep)
    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block, mp_policy=cast)
    fully_shard(model, mp_policy=cast)
    return model


def run(policy: str, wrap: str, rank: int) -> dict[str, Any]:
    prec = mixprec.Precision(policy)
    model = prec.prepare(sharded_model.build())
    if wrap == "fsdp":
        model = shard(model, prec.policy)
        kinds = {type(p).__name__ for p in model.parameters()}
        assert kinds == {"DTensor"}, kinds
    else:
        model = DistributedDataParallel(model)
    opt = prec.optimizer(model, lr=1e-3)
    x, y = sharded_model.batch(rank)

    def step() -> None:
        with prec.autocast():
            loss = sharded_model.loss_fn(model(x), y)
        prec.backward(loss)
        assert prec.step(opt).applied

    measured = measure(model, opt, step, policy=prec.policy)
    formats = opt.formats()  # type: ignore[attr-defined]
    return {
        "measure": measured.per_rank.to_dict(),
        "training_state": training_state_bytes(opt),
        "formats": [list(f) for f in formats],
    }


def main() -> None:
    out = Path(sys.argv[1])
    warnings.simplefilter("ignore")
    # The group's teardown collects the runs' objects first (mixprec.distributed).
    with process_group("cpu"):
        rank = dist.get_rank()
        mine = {f"{w}/{p}": run(p, w, rank) for w in ("fsdp", "ddp") for p in POLICIES}
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        if rank == 0:
            out.write_text(json.dumps(every))


if __name__ == "__main__":
    main()
