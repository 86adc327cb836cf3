"""Do two-rank scripts that follow docs/distributed.md's "From Python" recipe exit?

Each run is one ``torch.multiprocessing.spawn`` of 2 gloo ranks that wrap a tiny
model (``ddp`` or ``shard``), take 2 steps and leave; a run still alive after
``--timeout`` seconds has its processes' state and CPU use printed: if none used CPU
in 3 s it is a hang and is killed; otherwise it is slow (a loaded machine) and is
given another ``--timeout``.

    python bench/dist_exit.py --strategy ddp --runs 30 [--recipe raw|helper] [--parallel 4]
                              [--cycles 20] [--gdb]

``--recipe raw`` is the bare recipe (``init_process_group`` ... ``destroy_process_group``
with the model still alive); ``helper`` is the same loop inside
``mixprec.distributed.process_group``.
"""

from __future__ import annotations

import argparse
import gc
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

import mixprec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.distributed.exit_worker import train


def _rank(rank: int, strategy: str, recipe: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank))
    if recipe == "raw":  # the model is alive when the group is destroyed
        dist.init_process_group("gloo")
        model = train(strategy)
        dist.destroy_process_group()
        del model  # the reducer, now the group's last owner, destroys it
    else:
        with mixprec.distributed.process_group("cpu"):
            train(strategy)


def _cycles(rank: int, strategy: str, recipe: str, cycles: int, folder: str) -> None:
    """`cycles` groups one after the other in this process, torn down in the recipe's
    order (the helper's order written out: `process_group` joins one group per process)."""
    for i in range(cycles):
        store = dist.FileStore(os.path.join(folder, f"store{i}"), 2)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
        model = train(strategy)
        if recipe == "raw":
            dist.destroy_process_group()
            del model
        else:
            del model
            gc.collect()
            dist.barrier()
            dist.destroy_process_group()


def _one(strategy: str, recipe: str, cycles: int) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2")
    if cycles == 0:
        torch.multiprocessing.spawn(_rank, args=(strategy, recipe), nprocs=2)
        return
    with tempfile.TemporaryDirectory() as folder:
        torch.multiprocessing.spawn(_cycles, args=(strategy, recipe, cycles, folder), nprocs=2)


def _tree(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    kids = [int(p) for p in out.stdout.split()]
    return [pid] + [q for k in kids for q in _tree(k)]


def _cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def _stuck(pid: int, gdb: bool) -> bool:
    """Whether the run `pid` used no CPU in 3 s (a deadlock, not a slow run); prints its
    processes' state, and with `gdb` a stuck rank's stacks."""
    pids = _tree(pid)
    before = {p: _cpu_ticks(p) for p in pids}
    time.sleep(3)
    used = {p: (_cpu_ticks(p) - before[p]) / os.sysconf("SC_CLK_TCK") / 3 for p in pids}
    for p in pids:
        with open(f"/proc/{p}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        print(f"    pid {p}: state {state}, {100 * used[p]:.0f}% CPU over 3 s", flush=True)
    if any(used.values()):
        return False
    for p in pids[2:] if gdb else []:  # the ranks (after the runner and mp.spawn's parent)
        bt = subprocess.run(
            ["gdb", "-p", str(p), "-batch", "-ex", "thread apply all bt 16"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        frames = [line for line in bt.stdout.splitlines() if line.startswith(("#", "Thread"))]
        print("\n".join("      " + line for line in frames), flush=True)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=["ddp", "fsdp2"], default="ddp")
    parser.add_argument("--recipe", choices=["raw", "helper"], default="helper")
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--timeout", type=float, default=60)
    parser.add_argument(
        "--cycles",
        type=int,
        default=0,
        help="instead of one group per process: this many groups one after the other in "
        "each spawn (torn down in the recipe's order; more exits per second)",
    )
    parser.add_argument("--parallel", type=int, default=1, help="runs at once")
    parser.add_argument("--gdb", action="store_true", help="print a hung rank's stacks")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        _one(args.strategy, args.recipe, args.cycles)
        return
    env = dict(os.environ, OMP_NUM_THREADS="1")
    argv = [sys.executable, __file__, "--one", "--strategy", args.strategy]
    argv += ["--recipe", args.recipe, "--cycles", str(args.cycles)]
    hangs = failures = 0
    start = time.perf_counter()
    for first in range(0, args.runs, args.parallel):
        wave = range(first, min(first + args.parallel, args.runs))
        t0 = time.perf_counter()
        procs = {i: subprocess.Popen(argv, env=env) for i in wave}
        deadline = t0 + args.timeout
        for i, proc in procs.items():
            while True:
                try:
                    code = proc.wait(timeout=max(deadline - time.perf_counter(), 0.1))
                    failures += code != 0
                    print(f"run {i}: exit {code} in {time.perf_counter() - t0:.1f} s", flush=True)
                    break
                except subprocess.TimeoutExpired:
                    print(f"run {i}: still running after {time.perf_counter() - t0:.0f} s")
                    if not _stuck(proc.pid, args.gdb):
                        deadline = time.perf_counter() + args.timeout  # slow, not stuck
                        continue
                    hangs += 1
                    print(f"run {i}: hung (no CPU used)", flush=True)
                    for p in reversed(_tree(proc.pid)):
                        os.kill(p, 9)
                    proc.wait()
                    break
    total = time.perf_counter() - start
    print(
        f"{args.strategy} {args.recipe}: {args.runs} runs, {hangs} hung, {failures} failed, "
        f"{total:.0f} s ({total / args.runs:.1f} s a run)"
    )
    sys.exit(1 if hangs or failures else 0)


if __name__ == "__main__":
    main()
