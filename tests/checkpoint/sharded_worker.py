"""One rank of the sharded-checkpoint test (run by test_sharded.py, two gloo processes).

Usage: RANK=r WORLD_SIZE=2 MASTER_ADDR=... MASTER_PORT=... python sharded_worker.py OUT ROOT
Runs every scenario in turn and writes this rank's results to OUT/rank<r>.pt
(rank 0 also writes OUT/export2.safetensors). ROOT holds the checkpoints;
ROOT/single is a one-process checkpoint the test wrote before starting the ranks.
"""

from __future__ import annotations

import shutil
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
import sharded_cases as cases

from mixprec import checkpoint
from mixprec.distributed.launch import process_group


def fsdp_run(root: Path, out: Path, rank: int, world: int) -> dict[str, Any]:
    """6 steps, saved after 3 and 6, exported after 6."""
    cases.seed_everything(rank)
    model, opt, prec = cases.build("bf16_master", "fsdp")
    losses = cases.train(model, opt, prec, 0, cases.SAVE_AT, rank=rank, world=world)
    info = checkpoint.save(root, model=model, optimizer=opt, precision=prec, step=cases.SAVE_AT)
    complete = checkpoint.verify(info.path).step  # complete on every rank once save returns
    probe = cases.probe()
    losses += cases.train(model, opt, prec, cases.SAVE_AT, cases.STEPS, rank=rank, world=world)
    checkpoint.save(root, model=model, optimizer=opt, precision=prec, step=cases.STEPS)
    exported = checkpoint.export(
        model, opt, out / "export2.safetensors", "fp32", policy=prec.policy, step=cases.STEPS
    )
    return {
        "losses": losses,
        "snapshot": cases.snapshot(model, opt),
        "probe": probe,
        "verified_step": complete,
        "manifest": {"files": sorted(info.files)},
        "export_written": exported.written,
    }


def refused(root: Path, rank: int) -> dict[str, Any]:
    """A save that rank 1 cannot do (an unstorable extra) is refused by both ranks."""
    model, opt, prec = cases.build("bf16_master", "fsdp")
    extra = {"bad": object()} if rank == 1 else {}
    try:
        checkpoint.save(root, model=model, optimizer=opt, precision=prec, step=99, extra=extra)
    except checkpoint.CheckpointError as exc:
        return {"error": str(exc), "latest": checkpoint.resolve(root).step}
    return {"error": None}


def resumed(root: Path, rank: int, world: int, resume: int | str) -> dict[str, Any]:
    """A fresh 2-rank run (other seeds) that loads a checkpoint and trains to the end."""
    cases.seed_everything(50 + rank)
    model, opt, prec = cases.build("bf16_master", "fsdp")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = checkpoint.load(root, model=model, optimizer=opt, precision=prec, resume=resume)
    probe = cases.probe()
    losses = cases.train(model, opt, prec, loaded["step"], cases.STEPS, rank=rank, world=world)
    return {
        "losses": losses,
        "snapshot": cases.snapshot(model, opt),
        "probe": probe,
        "warnings": [str(w.message) for w in caught],
    }


def corrupt(root: Path, bad: Path, rank: int) -> dict[str, Any]:
    """One bit flipped in a DCP data file: both ranks raise the same error."""
    if rank == 0:
        name = f"step_{cases.SAVE_AT:08d}"
        shutil.copytree(root / name, bad / name)
        (bad / "latest").write_text(name + "\n")
        data = bad / name / "__1_0.distcp"
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0x01
        data.write_bytes(bytes(raw))
    dist.barrier()
    model, opt, prec = cases.build("bf16_master", "fsdp")
    try:
        checkpoint.load(bad, model=model, optimizer=opt, precision=prec)
    except checkpoint.CheckpointError as exc:
        return {"error": str(exc)}
    return {"error": None}


def ddp_run(root: Path, out: Path, rank: int, world: int) -> dict[str, Any]:
    """DDP (replicated): saved once after 3 steps, from rank 0's data."""
    cases.seed_everything(rank)
    model, opt, prec = cases.build("amp_bf16", "ddp")
    losses = cases.train(model, opt, prec, 0, cases.SAVE_AT, rank=rank, world=world)
    info = checkpoint.save(root, model=model, optimizer=opt, precision=prec, step=cases.SAVE_AT)
    state = {k: v.clone() for k, v in model.module.state_dict().items()}
    exported = checkpoint.export(model, opt, out / "ddp.safetensors", "fp32")
    losses += cases.train(model, opt, prec, cases.SAVE_AT, cases.STEPS, rank=rank, world=world)
    return {"losses": losses, "state": state, "files": sorted(info.files), "export": exported}


def main() -> None:
    out, root = Path(sys.argv[1]), Path(sys.argv[2])
    # The group's teardown collects the runs' objects first (mixprec.distributed).
    with process_group("cpu"):
        rank, world = dist.get_rank(), dist.get_world_size()
        results = {
            "run": fsdp_run(root / "fsdp", out, rank, world),
            "refused": refused(root / "fsdp", rank),
            "resumed": resumed(root / "fsdp", rank, world, cases.SAVE_AT),
            "corrupt": corrupt(root / "fsdp", root / "bad", rank),
            "from_single": resumed(root / "single", rank, world, "latest"),
            "ddp": ddp_run(root / "ddp", out, rank, world),
        }
        torch.save(results, out / f"rank{rank}.pt")


if __name__ == "__main__":
    main()
