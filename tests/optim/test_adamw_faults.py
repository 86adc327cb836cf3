"""Fault injection for `mixprec.optim.AdamW`: copies and half-loaded state."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch

from mixprec.optim import AdamW


def _setup(master: str, moments: str) -> tuple[list[torch.nn.Parameter], AdamW]:
    torch.manual_seed(0)
    dtype = torch.float32 if master == "none" else torch.bfloat16
    params = [
        torch.nn.Parameter(torch.randn(64, 64).to(dtype)),
        torch.nn.Parameter(torch.randn(64).to(dtype)),
    ]
    opt = AdamW(params, lr=1e-2, master=master, moments=moments, min_int8_numel=256, fused=False)
    return params, opt


def _grads(params: list[torch.nn.Parameter], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


@pytest.mark.parametrize(
    ("master", "moments"),
    [("none", "fp32"), ("exact", "fp32"), ("remainder8", "int8"), ("stochastic", "bf16")],
)
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copied_optimizer_steps_like_the_original(master: str, moments: str, how: str) -> None:
    """deepcopy and pickle lost the formats: step() raised AttributeError: _plans."""
    params, opt = _setup(master, moments)
    _grads(params, 1)
    opt.step()
    if how == "deepcopy":
        params2, opt2 = copy.deepcopy((params, opt))
    else:
        params2, opt2 = pickle.loads(pickle.dumps((params, opt)))
    for seed in (2, 3):
        _grads(params, seed)
        _grads(params2, seed)
        opt.step()
        opt2.step()
    for a, b in zip(params, params2, strict=True):
        assert torch.equal(a.detach(), b.detach())
    assert opt2.formats() == opt.formats()


def test_torch_save_of_an_optimizer_round_trips() -> None:
    params, opt = _setup("exact", "fp32")
    _grads(params, 1)
    opt.step()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    _params2, opt2 = _setup("exact", "fp32")
    opt2.load_state_dict(loaded)
    for pid, state in opt.state_dict()["state"].items():
        for key, value in state.items():
            assert torch.equal(opt2.state_dict()["state"][pid][key], value), (pid, key)


def test_a_bad_entry_changes_nothing() -> None:
    """The state of earlier params used to be overwritten before the bad one raised."""
    params, opt = _setup("exact", "fp32")
    _grads(params, 1)
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    _grads(params, 2)
    opt.step()
    current = copy.deepcopy(opt.state_dict())
    broken = copy.deepcopy(saved)
    last = max(broken["state"])
    broken["state"][last]["exp_avg"] = broken["state"][last]["exp_avg"][:3]
    with pytest.raises(ValueError, match="exp_avg"):
        opt.load_state_dict(broken)
    missing = copy.deepcopy(saved)
    del missing["state"][last]
    with pytest.raises(ValueError, match="do not match"):
        opt.load_state_dict(missing)
    bad_lr = copy.deepcopy(saved)
    bad_lr["param_groups"][0]["lr"] = -1.0
    with pytest.raises(ValueError, match="invalid lr"):
        opt.load_state_dict(bad_lr)
    after = opt.state_dict()
    for pid, state in current["state"].items():
        for key, value in state.items():
            assert torch.equal(after["state"][pid][key], value), (pid, key)
    assert after["param_groups"] == current["param_groups"]
