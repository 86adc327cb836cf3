"""Launch `worker.py` on 2 gloo processes and collect each rank's results."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

WORKER = Path(__file__).with_name("worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(out: Path, *scenarios: str, world: int = 2, timeout: int = 300) -> list[Any]:
    """Run `scenarios` on `world` ranks; each rank's results (by scenario name)."""
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    env.update(WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(out), *scenarios],
            env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world)
    ]
    logs = []
    for proc in procs:
        try:
            logs.append(proc.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail(f"distributed worker timed out: {scenarios}")
    for proc, log in zip(procs, logs, strict=True):
        assert proc.returncode == 0, log[-3000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]
