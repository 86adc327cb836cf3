"""A checkpoint of another policy or optimizer is refused naming what differs, or
converted when asked, losing nothing the new formats can hold."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tests.checkpoint import loop

import mixprec
from mixprec import checkpoint
from mixprec.checkpoint import CheckpointError, CheckpointWarning

FP32_MASTER = mixprec.Policy(
    name="bf16_fp32_master",
    compute_dtype=torch.bfloat16,
    param_dtype=torch.bfloat16,
    master="fp32",
    moments="fp32",
)


def _saved(root: Path, policy: mixprec.Policy | str) -> tuple[dict[str, torch.Tensor], object]:
    loop.seed_everything()
    model, optimizer, prec = loop.build(policy)  # type: ignore[arg-type]
    loop.train(model, optimizer, prec, 0, 3)
    checkpoint.save(root, model=model, optimizer=optimizer, precision=prec, step=3)
    return loop.snapshot(model, optimizer), optimizer


def test_another_policy_is_refused_naming_the_fields(tmp_path: Path) -> None:
    _saved(tmp_path, FP32_MASTER)
    model, optimizer, prec = loop.build("bf16_master")
    before = loop.snapshot(model, optimizer)
    with pytest.raises(CheckpointError) as info:
        checkpoint.load(tmp_path, model=model, optimizer=optimizer, precision=prec)
    message = str(info.value)
    assert "master (saved 'fp32', now 'exact')" in message and "convert=True" in message
    after = loop.snapshot(model, optimizer)
    assert all(torch.equal(loop.bits(v), loop.bits(after[k])) for k, v in before.items())


def test_an_fp32_master_converts_to_an_exact_master_bitwise(tmp_path: Path) -> None:
    saved, _ = _saved(tmp_path, FP32_MASTER)
    model, optimizer, prec = loop.build("bf16_master")
    with pytest.warns(CheckpointWarning, match="masters decoded to fp32 and re-encoded"):
        got = checkpoint.load(
            tmp_path, model=model, optimizer=optimizer, precision=prec, convert=True
        )
    assert got["converted"]
    now = loop.snapshot(model, optimizer)
    masters = [k for k in saved if k.startswith("master/")]
    assert masters
    for key in masters:  # the exact master holds the fp32 master bit for bit
        assert torch.equal(loop.bits(saved[key]), loop.bits(now[key])), key
    for key in (k for k in saved if k.endswith(("/exp_avg", "/exp_avg_sq"))):
        assert torch.equal(saved[key], now[key]), key  # fp32 moments through fp32
    assert optimizer.formats()[0] == ("exact", "fp32")
    losses = loop.train(model, optimizer, prec, 3, 5)
    assert all(torch.isfinite(torch.tensor(losses)))


def test_a_mixprec_run_converts_into_torch_adamw_under_fp32(tmp_path: Path) -> None:
    saved, _ = _saved(tmp_path, "bf16_master")
    model = loop.make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    prec = mixprec.Precision("fp32")
    with pytest.raises(CheckpointError, match=r"optimizer \(saved mixprec.optim.AdamW, now torch"):
        checkpoint.load(tmp_path, model=model, optimizer=optimizer, precision=prec)
    with pytest.warns(CheckpointWarning):
        checkpoint.load(tmp_path, model=model, optimizer=optimizer, precision=prec, convert=True)
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32
        assert torch.equal(loop.bits(p.detach()), loop.bits(saved[f"master/{name}"])), name
        state = optimizer.state[p]
        assert torch.equal(state["exp_avg"], saved[f"state/{name}/exp_avg"]), name
        assert float(state["step"]) == 3


def test_a_torch_adamw_run_converts_into_mixprec(tmp_path: Path) -> None:
    model = loop.make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    prec = mixprec.Precision("fp32")
    loop.train(model, optimizer, prec, 0, 2)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    checkpoint.save(tmp_path, model=model, optimizer=optimizer, precision=prec, step=2)

    model, mine, prec = loop.build("fp32")
    with pytest.warns(CheckpointWarning, match="torch.optim.AdamW state dict, converting"):
        checkpoint.load(tmp_path, model=model, optimizer=mine, precision=prec, convert=True)
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), weights[name]), name
    assert float(mine.state[next(iter(model.parameters()))]["step"]) == 2
