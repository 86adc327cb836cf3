"""Running one command on several local processes, and joining the process group.

`spawn` is what ``mixprec train --nproc N`` does when it is not under ``torchrun``
already: it starts N copies of the command with torchrun's environment (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), forwards Ctrl-C
and SIGTERM to every copy (each stops after its step in progress, together, with a
checkpoint), and returns rank 0's exit code (another rank's if rank 0 succeeded and
it did not). `process_group` joins the group such an environment describes: gloo
on CPUs, NCCL on CUDA devices, one device per local rank.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

__all__ = ["launched_world_size", "process_group", "rank", "spawn", "world_size"]


def launched_world_size() -> int:
    """The ``WORLD_SIZE`` of the environment (torchrun's, or `spawn`'s); 1 without one."""
    text = os.environ.get("WORLD_SIZE", "1")
    try:
        return max(int(text), 1)
    except ValueError:
        raise ValueError(f"WORLD_SIZE must be a whole number, got {text!r}") from None


def world_size() -> int:
    """The number of ranks of the initialized process group (1 without one): the one
    home of this and `rank` (checkpoints, `mixprec train`)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    """This process's rank in the initialized process group (0 without one)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


@contextlib.contextmanager
def process_group(device: str) -> Iterator[str]:
    """Within the block, this process is a rank of the group its environment describes
    (nothing to join for a world of 1); yields the device this rank trains on.

    The group is destroyed on the way out, whatever happens.
    """
    if launched_world_size() == 1 or (dist.is_available() and dist.is_initialized()):
        yield device
        return
    if not dist.is_available():
        raise ValueError("this torch build has no torch.distributed; run with --nproc 1")
    dev = torch.device(device)
    if dev.type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    ok = False
    try:
        yield device
        ok = True
    finally:
        # The run's wrappers (DDP's reducer, FSDP2's state) sit in reference cycles
        # that hold the group's pending work and tensors: collected at interpreter
        # exit, after the group is gone, they can abort the process ("terminate called
        # without an active exception"). Collect them now, while everything is alive.
        gc.collect()
        if ok:
            dist.barrier()  # every rank reaches teardown before any tears down
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn(argv: Sequence[str], nproc: int) -> int:
    """Run ``python -m mixprec *argv`` on `nproc` local ranks (see the module docs)."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    env.update(WORLD_SIZE=str(nproc))
    # Each rank computes on its share of the cores (as torchrun sets it).
    env.setdefault("OMP_NUM_THREADS", str(max((os.cpu_count() or 1) // nproc, 1)))
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "mixprec", *argv],
            env=dict(env, RANK=str(r), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(nproc)),
            # A terminal's Ctrl-C reaches the launcher alone, which forwards it once (a
            # second one would make the ranks stop at once, without a checkpoint).
            start_new_session=True,
        )
        for r in range(nproc)
    ]

    def forward(signum: int, frame: object) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        codes = [_exit_code(p.wait()) for p in procs]
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for p in procs:  # a launcher stopped by an error leaves no rank behind
            if p.poll() is None:
                p.kill()
    return codes[0] if codes[0] != 0 else next((c for c in codes if c != 0), 0)


def _exit_code(returncode: int) -> int:
    """A rank's exit status as a shell reports it: 128 + N for a rank ended by signal N
    (a second SIGTERM ends the ranks at once: 143, as for one process)."""
    return 128 - returncode if returncode < 0 else returncode
