"""2N steps in one go equal N steps, a save, and N more in a new process, bitwise."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tests.checkpoint import loop

N = 4
CHILD = Path(__file__).with_name("child.py")


def _child_env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    src = str(Path(__file__).resolve().parents[2] / "src")
    env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
    return env


@pytest.mark.slow
def test_every_preset_resumes_bitwise_in_a_new_process(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    expected = {}
    for policy in loop.PRESETS:
        loop.seed_everything()
        model, optimizer, prec = loop.build(policy)
        losses = loop.train(model, optimizer, prec, 0, 2 * N)
        expected[policy] = (losses, loop.snapshot(model, optimizer))
        first = loop.run_then_save(policy, tmp_path / policy, N)
        assert first == losses[:N], policy
    out = tmp_path / "resumed.pt"
    subprocess.run(
        [
            sys.executable,
            str(CHILD),
            "resume",
            str(tmp_path),
            str(2 * N),
            str(out),
            ",".join(loop.PRESETS),
        ],
        check=True,
        env=_child_env(),
        timeout=300,
    )
    resumed = torch.load(out, weights_only=True)
    for policy in loop.PRESETS:
        losses, state = expected[policy]
        got = resumed[policy]
        assert got["losses"].tolist() == losses[N:], policy
        assert set(got) - {"losses"} == set(state), policy
        for key, value in state.items():
            assert value.dtype == got[key].dtype, (policy, key)
            assert torch.equal(loop.bits(value), loop.bits(got[key])), (policy, key)
