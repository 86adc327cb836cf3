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

__all__ = [
    "launched_world_size",
    "process_group",
    "rank",
    "require_process_group",
    "spawn",
    "world_size",
]


def launched_world_size() -> int:
    """The ``WORLD_SIZE`` of the environment (torchrun's, or `spawn`'s); 1 without one.

    Raises:
        ValueError: ``RANK`` is set without ``WORLD_SIZE``, or either is not a number.
    """
    if "RANK" in os.environ and "WORLD_SIZE" not in os.environ:
        raise ValueError(
            f"RANK={os.environ['RANK']!r} is set but WORLD_SIZE is not: set both (and "
            "MASTER_ADDR, MASTER_PORT) for every rank, as torchrun does"
        )
    text = os.environ.get("WORLD_SIZE", "1")
    try:
        return max(int(text), 1)
    except ValueError:
        raise ValueError(f"WORLD_SIZE must be a whole number, got {text!r}") from None


def world_size() -> int:
    """The number of ranks of the initialized process group (1 without one): the one
    home of this and `rank` (checkpoints, `mixprec train`)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def require_process_group(wrapper: str) -> None:
    """Raise one line naming the fix when no process group is initialized (`wrapper` is
    the function that needs one, e.g. ``"mixprec.distributed.ddp"``)."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            f"{wrapper} needs a process group, and none is initialized: run the script "
            "under torchrun (or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT per rank) "
            "and wrap inside mixprec.distributed.process_group(); on one process, train the "
            "model unwrapped"
        )


def rank() -> int:
    """This process's rank in the initialized process group (0 without one)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


@contextlib.contextmanager
def process_group(device: str = "cpu") -> Iterator[str]:
    """Within the block, this process is a rank of the group its environment describes;
    yields the device this rank trains on.

    The environment is torchrun's, or `spawn`'s: ``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT`` (under ``torch.multiprocessing.spawn``, set them
    before entering). The group is gloo on CPUs and NCCL on CUDA, where ``"cuda"``
    becomes ``cuda:LOCAL_RANK``. A world of 1, or a group already joined, is left as
    it is.

    On the way out, whatever happened, the group is torn down in the order that cannot
    hang: what still holds it is collected while it is alive, every rank waits for the
    others (when the block succeeded), then the group is destroyed.

    Train in a function called within the block, so that the models it wraps are gone
    when the block ends: a DDP model that outlives the group can hang the process at
    exit.

    Raises:
        RuntimeError: a ``DistributedDataParallel`` model made within the block is
            still alive at its end (raised after the teardown).
    """
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device {device!r} is not a torch device; use 'cpu' or 'cuda'") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r}: torch sees no CUDA device here; use 'cpu'")
        local = int(os.environ.get("LOCAL_RANK", "0")) if dev.index is None else dev.index
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    if launched_world_size() == 1 or (dist.is_available() and dist.is_initialized()):
        yield device
        return
    if not dist.is_available():
        raise ValueError("this torch build has no torch.distributed; run with --nproc 1")
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    ok = kept = False
    try:
        yield device
        ok = True
    finally:
        # DDP's reducer holds the group from C++. Freed after destroy_process_group, it
        # is the group's last owner, and gloo's destructor then joins its worker threads
        # while holding the GIL, which a worker finishing the last collective needs to
        # free that collective's tensors: a deadlock (1 exit in about 16 under load).
        # Collected now (reference cycles included), the reducer leaves the group to
        # destroy_process_group, which destroys it with the GIL released. Collected at
        # interpreter exit instead, after the group, the same objects can abort the
        # process ("terminate called without an active exception").
        gc.collect()
        kept = ok and _ddp_alive()
        if ok:
            dist.barrier()  # every rank reaches teardown before any tears down
        dist.destroy_process_group()
    if kept:
        raise RuntimeError(
            "a DistributedDataParallel model made within mixprec.distributed.process_group "
            "is still alive at its end, and can hang the process when it is freed; train in "
            "a function called within the block, or `del` the model before the block ends"
        )


def _ddp_alive() -> bool:
    ddp_type = torch.nn.parallel.DistributedDataParallel
    # type(), not isinstance(): DDP is an ABC, whose check reads each object's
    # __class__, and some objects warn when read (torch.distributed.reduce_op).
    return any(issubclass(cls, ddp_type) for cls in {type(obj) for obj in gc.get_objects()})


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
