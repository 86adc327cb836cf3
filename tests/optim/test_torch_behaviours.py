"""Generic optimizer behaviours torch tests for every optimizer, on `mixprec.optim.AdamW`.

A port of the behaviours of torch's generic optimizer tests that a drop-in must keep:
step hooks, state-dict hooks, `add_param_group`, `zero_grad`, closures, schedulers,
deepcopy and a `weights_only` round trip into a fresh optimizer continuing identically.
"""

from __future__ import annotations

import copy
import io

import torch

from mixprec.optim import AdamW


def _params() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(4, 6)), torch.nn.Parameter(torch.randn(6))]


def _fill_grads(params: list[torch.nn.Parameter], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)


def test_step_and_state_dict_hooks_run_in_order() -> None:
    params = _params()
    opt = AdamW(params, lr=1e-2)
    calls: list[str] = []
    opt.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
    opt.register_step_post_hook(lambda o, a, k: calls.append("post"))
    opt.register_state_dict_pre_hook(lambda o: calls.append("sd-pre"))
    opt.register_state_dict_post_hook(lambda o, sd: calls.append("sd-post") or sd)
    opt.register_load_state_dict_pre_hook(lambda o, sd: calls.append("load-pre") or sd)
    opt.register_load_state_dict_post_hook(lambda o: calls.append("load-post"))
    _fill_grads(params, 1)
    opt.step()
    opt.load_state_dict(opt.state_dict())
    assert calls == ["pre", "post", "sd-pre", "sd-post", "load-pre", "load-post"]


def test_closure_zero_grad_and_add_param_group() -> None:
    params = _params()
    opt = AdamW(params[:1], lr=1e-2)
    opt.add_param_group({"params": params[1:], "lr": 1e-3, "weight_decay": 0.0})
    assert [g["lr"] for g in opt.param_groups] == [1e-2, 1e-3]

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = sum(p.pow(2).sum() for p in params)
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor)
    opt.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in params)
    opt.zero_grad(set_to_none=False)  # no grads to zero: stays None, as in torch


def test_a_weights_only_round_trip_into_a_fresh_optimizer_continues_identically() -> None:
    params = _params()
    opt = AdamW(params, lr=1e-2, master="auto")
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    for seed in range(3):
        _fill_grads(params, seed)
        opt.step()
        sched.step()
    buf = io.BytesIO()
    torch.save({"opt": opt.state_dict(), "sched": sched.state_dict(), "params": params}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    params2 = [torch.nn.Parameter(p.detach().clone()) for p in saved["params"]]
    opt2 = AdamW(params2, lr=1e-2, master="auto")
    sched2 = torch.optim.lr_scheduler.CosineAnnealingLR(opt2, T_max=10)
    opt2.load_state_dict(saved["opt"])
    sched2.load_state_dict(saved["sched"])
    twin, twin_sched = copy.deepcopy((opt, sched))  # a deepcopy steps like the original too
    twin_params = [p for g in twin.param_groups for p in g["params"]]
    for seed in range(3, 6):
        for ps, o, s in ((params, opt, sched), (params2, opt2, sched2)):
            _fill_grads(ps, seed)
            o.step()
            s.step()
        _fill_grads(twin_params, seed)
        twin.step()
        twin_sched.step()
    for a, b, c in zip(params, params2, twin_params, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert opt.param_groups[0]["lr"] == opt2.param_groups[0]["lr"]
