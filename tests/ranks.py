"""Launch a worker script as several gloo ranks (the distributed tests' one launcher)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

SRC = str(Path(__file__).resolve().parents[1] / "src")


def free_port() -> int:
    """A TCP port free on this machine now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(argv: Sequence[str], *, world: int = 2, timeout: float = 300) -> list[str]:
    """Run ``python *argv`` as `world` ranks (torchrun's environment, one thread each,
    this checkout's source first); the test fails on a hang (every rank is killed)
    or a rank's non-zero exit. Returns each rank's output."""
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    env.update(WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([SRC, env.get("PYTHONPATH", "")])
    procs = [
        subprocess.Popen(
            [sys.executable, *argv],
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
            pytest.fail(f"ranks of {argv[0]} timed out (a hang?)")
    for proc, log in zip(procs, logs, strict=True):
        assert proc.returncode == 0, log[-3000:]
    return logs
