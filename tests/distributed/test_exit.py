"""Scripts that follow docs/distributed.md's "From Python" recipe exit (issue 30, item 5:
a two-rank DDP over gloo hung at exit in 1 of 16 ``mp.spawn`` runs, its reducer
outliving ``destroy_process_group``).

Each run is one ``torch.multiprocessing.spawn`` of 2 ranks. A run still alive after
`RUN_TIMEOUT` seconds fails as a hang only when its ranks used no CPU for
`STUCK_WINDOW` seconds (under a loaded machine a slow run is given more time).
bench/dist_exit.py runs the same loop 30 times per strategy, and the bare recipe.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from ranks import free_port

from . import exit_worker

#: Spawns per strategy in the default suite (bench/dist_exit.py runs 30).
RUNS = 3
RUN_TIMEOUT = 60.0
STUCK_WINDOW = 3.0


@pytest.fixture(autouse=True)
def _rendezvous(monkeypatch: pytest.MonkeyPatch) -> None:
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100  # utime + stime, in clock ticks


def _spawn(monkeypatch: pytest.MonkeyPatch, fn: Callable[..., None], *args: Any) -> None:
    """Run ``fn(rank, *args)`` on 2 spawned ranks; fail on a hang, and on a rank's error."""
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    ctx = mp.start_processes(fn, args=args, nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + RUN_TIMEOUT
    while not ctx.join(timeout=max(deadline - time.monotonic(), 0.1)):
        if time.monotonic() < deadline:
            continue
        alive = [p.pid for p in ctx.processes if p.is_alive() and p.pid is not None]
        used = sum(_cpu_seconds(pid) for pid in alive)
        time.sleep(STUCK_WINDOW)
        if sum(_cpu_seconds(pid) for pid in alive) > used:
            deadline += RUN_TIMEOUT  # slow (a loaded machine), not stuck
            continue
        for p in ctx.processes:
            p.kill()
        pytest.fail(f"ranks {alive} hung: no CPU used in {STUCK_WINDOW} s after {RUN_TIMEOUT} s")


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_the_recipe_exits_every_time(monkeypatch: pytest.MonkeyPatch, strategy: str) -> None:
    for _ in range(RUNS):
        _spawn(monkeypatch, exit_worker.recipe, strategy)


def test_a_ddp_model_alive_at_the_end_of_the_block_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _spawn(monkeypatch, exit_worker.model_kept, str(tmp_path))
    for rank in range(2):
        message = (tmp_path / f"rank{rank}.txt").read_text()
        assert "DistributedDataParallel" in message and "process_group" in message
