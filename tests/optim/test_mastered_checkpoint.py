"""`Mastered` in checkpoints: 2N steps in one go equal N steps, a save, and N more in a
new process, bitwise (masters, parameters, the inner optimizer's state, losses)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tests.checkpoint import loop
from tests.optim import mastered_resume

from mixprec import checkpoint

N = 3
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_mastered_run_resumes_bitwise_in_a_new_process(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    expected = {}
    for name in mastered_resume.OPTIMIZERS:
        loop.seed_everything()
        model, optimizer, prec = mastered_resume.build(name)
        losses = loop.train(model, optimizer, prec, 0, 2 * N)
        expected[name] = (losses, mastered_resume.snapshot(model, optimizer))
        assert mastered_resume.run_then_save(name, tmp_path / name, N) == losses[:N]
    assert checkpoint.resolve(tmp_path / "sgd").optimizer == "mixprec.optim.Mastered"
    out = tmp_path / "resumed.pt"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), str(REPO), env.get("PYTHONPATH", "")])
    subprocess.run(
        [sys.executable, "-m", "tests.optim.mastered_resume", str(tmp_path), str(2 * N), str(out)],
        check=True,
        env=env,
        cwd=REPO,
        timeout=300,
    )
    resumed = torch.load(out, weights_only=True)
    for name, (losses, state) in expected.items():
        got = resumed[name]
        assert got["losses"].tolist() == losses[N:], name
        assert set(got) - {"losses"} == set(state), name
        assert any(key.endswith("remainder_hi") for key in state)  # masters were saved
        for key, value in state.items():
            assert value.dtype == got[key].dtype, (name, key)
            assert torch.equal(loop.bits(value), loop.bits(got[key])), (name, key)


def test_an_fp32_export_is_its_exact_master_bitwise(tmp_path: Path) -> None:
    load_file = pytest.importorskip("safetensors.torch").load_file
    loop.seed_everything()
    model, optimizer, prec = mastered_resume.build("sgd")
    loop.train(model, optimizer, prec, 0, N)
    checkpoint.export(model, optimizer, tmp_path / "w.safetensors")
    saved = load_file(str(tmp_path / "w.safetensors"))
    masters = optimizer.master_weights()  # type: ignore[operator]
    for (name, p), master in zip(model.named_parameters(), masters, strict=True):
        assert torch.equal(saved[name].view(torch.int32), master.view(torch.int32)), name
        if p.dtype == torch.bfloat16:
            assert not torch.equal(saved[name], p.detach().float())  # not the rounded value
