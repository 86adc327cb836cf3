"""One rank of the int4 sharding test (run by test_int4.py, two gloo processes).

A weight sharded on dim 0 over both ranks is refused with one line; the same weight
replicated steps with int4 moments, and a bias sharded like FSDP2 keeps fp32 ones.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

from mixprec.distributed.launch import process_group
from mixprec.optim import AdamW


def main() -> None:
    with process_group("cpu"):
        mesh = init_device_mesh("cpu", (2,))
        weight = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
        sharded = nn.Parameter(distribute_tensor(weight, mesh, [Shard(0)]))
        try:
            AdamW([sharded], moments="int4")
        except ValueError as exc:
            print(f"refused: {exc}")
        replicated = nn.Parameter(distribute_tensor(weight, mesh, [Replicate()]))
        bias = nn.Parameter(distribute_tensor(torch.zeros(64), mesh, [Shard(0)]))
        opt = AdamW([replicated, bias], moments="int4", fused=False)
        replicated.grad = distribute_tensor(torch.ones(64, 128), mesh, [Replicate()])
        bias.grad = distribute_tensor(torch.ones(64), mesh, [Shard(0)])
        opt.step()
        print("replicated:", sorted(opt.state[replicated]))
        print("bias:", sorted(opt.state[bias]))


if __name__ == "__main__":
    main()
