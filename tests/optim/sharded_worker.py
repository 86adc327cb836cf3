"""One rank of the sharded-AdamW test (run by test_sharded.py, two gloo processes).

Usage: RANK=r WORLD_SIZE=2 MASTER_ADDR=... MASTER_PORT=... python sharded_worker.py OUT CKPT
Steps every case on DTensor params sharded on dim 0, saves and reloads them
with torch.distributed.checkpoint halfway, and (rank 0) writes the gathered
params, master weights and state to OUT for comparison with an unsharded run.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor, Shard, distribute_tensor, init_device_mesh

sys.path.insert(0, str(Path(__file__).parent))
import sharded_cases as cases

from mixprec.distributed.launch import process_group


def sharded_model(mesh: object, case: tuple) -> cases.Holder:
    params = [
        nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)]))  # type: ignore[arg-type]
        for p in cases.full_params(case)
    ]
    return cases.Holder(params)


def set_grads(model: cases.Holder, mesh: object, case: tuple, step: int) -> None:
    for p, g in zip(model.ps, cases.full_grads(case, step), strict=True):
        p.grad = distribute_tensor(g, mesh, [Shard(0)])  # type: ignore[arg-type]


def gather(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t.clone()


def main() -> None:
    # The group's teardown collects the run's objects first (mixprec.distributed):
    # the work runs in its own function, so none of them is still referenced then.
    with process_group("cpu"):
        work(Path(sys.argv[1]), Path(sys.argv[2]))


def work(out: Path, ckpt: Path) -> None:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    results = {}
    for index, case in enumerate(cases.CASES):
        model = sharded_model(mesh, case)
        opt = cases.make_optimizer(case, list(model.ps))
        assert not opt.state, "state is made at the first step, as in torch"
        for step in range(cases.SAVE_AT):
            set_grads(model, mesh, case, step)
            opt.step()
        kinds = {type(v).__name__ for s in opt.state.values() for v in s.values() if v.dim()}
        msd, osd = get_state_dict(model, opt)
        where = ckpt / str(index)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=where)
        # A fresh model and optimizer (other values) loaded from the checkpoint.
        model = sharded_model(mesh, case)
        with torch.no_grad():
            for p in model.ps:
                p.zero_()
        opt = cases.make_optimizer(case, list(model.ps))
        msd, osd = get_state_dict(model, opt)
        loaded = {"model": msd, "optim": osd}
        dcp.load(loaded, checkpoint_id=where)
        set_state_dict(
            model, opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"]
        )
        for step in range(cases.SAVE_AT, cases.STEPS):
            set_grads(model, mesh, case, step)
            opt.step()
        results[case] = {
            "state_types": sorted(kinds),
            "params": [gather(p.detach()) for p in model.ps],
            "masters": [gather(m) for m in opt.master_weights()],
            "state": [{k: gather(v) for k, v in opt.state[p].items()} for p in model.ps],
            "formats": opt.formats(),
        }
    # A real FSDP2 model: gradients arrive reduce-scattered as Shard(0) DTensors.
    from torch.distributed.fsdp import fully_shard

    model = cases.fsdp_model()
    fully_shard(model, mesh=mesh)
    opt = cases.fsdp_optimizer(list(model.parameters()))
    losses = cases.fsdp_train(model, opt, cases.STEPS)
    results["fsdp"] = {
        "losses": losses,
        "params": [gather(p.detach()) for p in model.parameters()],
        "backends": opt.kernel_backends(),
    }
    unaligned = nn.Parameter(
        distribute_tensor(
            torch.zeros(cases.UNALIGNED_SHAPE, dtype=torch.bfloat16), mesh, [Shard(0)]
        )
    )
    results["unaligned_formats"] = cases.make_optimizer(cases.CASES[0], [unaligned]).formats()
    if dist.get_rank() == 0:
        torch.save(results, out)


if __name__ == "__main__":
    main()
