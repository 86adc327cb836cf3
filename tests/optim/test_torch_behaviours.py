"""Generic optimizer behaviours torch tests for every optimizer, on `mixprec.optim.AdamW`.

A port of the behaviours of torch's generic optimizer tests that a drop-in must keep:
step hooks, state-dict hooks, `add_param_group`, `zero_grad`, closures, schedulers,
deepcopy and a `weights_only` round trip into a fresh optimizer continuing identically.
"""

from __future__ import annotations

import copy
import io

import pytest
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


@pytest.mark.parametrize("master", ["none", "exact", "kahan", "stochastic"])
def test_a_parameter_listed_twice_is_stepped_twice_in_turn(master: str) -> None:
    """torch warns about a parameter listed twice in a group and steps it twice, one
    step after the other (its for-loop). The fused path batches a group's parameters
    into one call, where both listings would update the same memory at once: the
    second listing must take its step after the first, as the eager path does."""
    dtype = torch.float32 if master == "none" else torch.bfloat16
    runs = []
    for fused in (False, True):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(4096 + 7).to(dtype))
        other = torch.nn.Parameter(torch.randn(33).to(dtype))
        with pytest.warns(UserWarning, match="duplicate parameters"):
            opt = AdamW([p, other, p], lr=1e-2, master=master, fused=fused, seed=0)
        for step in range(3):
            gen = torch.Generator().manual_seed(step)
            for q in (p, other):
                q.grad = torch.randn(q.shape, generator=gen).to(dtype)
            opt.step()
        assert float(opt.state[p]["step"]) == 6.0 and float(opt.state[other]["step"]) == 3.0
        runs.append(torch.cat([p.detach().reshape(-1), other.detach().reshape(-1)]))
    assert torch.equal(runs[0].view(torch.uint8), runs[1].view(torch.uint8))
    if master == "none":
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(4096 + 7))
        other = torch.nn.Parameter(torch.randn(33))
        with pytest.warns(UserWarning, match="duplicate parameters"):
            ref = torch.optim.AdamW([p, other, p], lr=1e-2, foreach=False)
        for step in range(3):
            _fill_grads([p, other], step)
            ref.step()
        torch.testing.assert_close(
            runs[1], torch.cat([p.detach(), other.detach()]), rtol=1e-6, atol=1e-6
        )


def test_parameters_put_into_param_groups_by_hand_are_stepped_as_torch_steps_them() -> None:
    """torch's optimizers step a parameter appended to ``group["params"]`` (its state is
    made at its first step); ours raised a KeyError showing the tensor."""
    params = _params()
    opt, ref = AdamW(params[:1], lr=1e-2), torch.optim.AdamW(params[:1], lr=1e-2)
    extra = [torch.nn.Parameter(params[1].detach().clone()) for _ in range(2)]
    opt.param_groups[0]["params"].append(extra[0])
    ref.param_groups[0]["params"].append(extra[1])
    assert opt.formats() == [("none", "fp32")] * 2  # planned before any step
    assert len(opt.master_weights()) == 2
    for step in range(3):
        _fill_grads([params[0], extra[0]], step)
        opt.step()
        _fill_grads([params[0], extra[1]], step)
        ref.step()
    torch.testing.assert_close(extra[0], extra[1], rtol=1e-6, atol=1e-6)
    assert float(opt.state[extra[0]]["step"]) == 3.0
    # the same parameter in two groups is refused, as add_param_group refuses it
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})
    opt.param_groups[1]["params"].append(extra[0])
    with pytest.raises(ValueError, match="two param groups"):
        opt.step()


@pytest.mark.parametrize("fused", [False, True])
def test_options_it_cannot_honour_are_refused_in_groups(fused: bool) -> None:
    """``decoupled_weight_decay=False`` (torch's AdamW is Adam with that key True; False is
    L2 decay) was stepped as decoupled decay."""
    params = _params()
    l2 = {"params": params[:1], "weight_decay": 0.5, "decoupled_weight_decay": False}
    with pytest.raises(ValueError, match="decoupled_weight_decay=False"):
        AdamW([l2], lr=0.1)
    opt = AdamW(params[:1], lr=0.1, fused=fused)
    with pytest.raises(ValueError, match="decoupled_weight_decay=False"):
        opt.add_param_group({"params": params[1:], "decoupled_weight_decay": False})
    assert len(opt.param_groups) == 1


def test_building_it_leaves_torchs_random_stream_alone() -> None:
    """Swapping torch.optim.AdamW for this one must not change later random draws (the
    default stochastic-rounding seed was drawn from torch's generator, advancing it)."""
    draws = []
    for build in (torch.optim.AdamW, AdamW):
        torch.manual_seed(0)
        build(_params(), lr=1e-3)
        draws.append(torch.randn(4))
    assert torch.equal(draws[0], draws[1])
    torch.manual_seed(1)
    a = AdamW([torch.nn.Parameter(torch.zeros(4).bfloat16())], master="stochastic")
    torch.manual_seed(1)
    b = AdamW([torch.nn.Parameter(torch.zeros(4).bfloat16())], master="stochastic")
    assert a._seed == b._seed  # still repeatable under torch.manual_seed


def test_the_way_to_change_formats_that_the_error_names_works() -> None:
    p = torch.nn.Parameter(torch.randn(64).bfloat16())
    opt = AdamW([p], lr=1e-2, master="exact")
    p.grad = torch.ones_like(p)
    opt.step()
    q = torch.nn.Parameter(p.detach().clone())
    new = AdamW([q], lr=1e-2, master="kahan", moments="bf16")
    new.load_state_dict(opt.torch_state_dict())
    new.load_master_weights(opt.master_weights())
    assert new.format_of(q) == ("kahan", "bf16")
    torch.testing.assert_close(new.master_weights()[0], opt.master_weights()[0])
    q.grad = torch.ones_like(q)
    new.step()
    assert float(new.state[q]["step"]) == 2.0


def test_two_parameters_sharing_memory_are_refused() -> None:
    """Parameter(buf) twice, or slices of one tensor, were accepted: each took its own step
    over the same values, and fused and eager disagreed."""
    buf = torch.randn(8).bfloat16()
    with pytest.raises(ValueError, match="share memory"):
        AdamW([torch.nn.Parameter(buf), torch.nn.Parameter(buf)])
    base = torch.randn(16)
    halves = [torch.nn.Parameter(base[:10]), torch.nn.Parameter(base[6:])]
    with pytest.raises(ValueError, match="share memory"):
        AdamW([{"params": halves[:1]}, {"params": halves[1:]}])
    opt = AdamW([torch.nn.Parameter(base[:8])])
    with pytest.raises(ValueError, match="share memory"):
        opt.add_param_group({"params": [torch.nn.Parameter(base[4:])]})
    assert len(opt.param_groups) == 1
    AdamW([torch.nn.Parameter(base[:8]), torch.nn.Parameter(base[8:])])  # adjacent: fine
    opt.param_groups[0]["params"].append(torch.nn.Parameter(base[2:6]))  # by hand
    opt.param_groups[0]["params"][-1].grad = torch.ones(4)
    with pytest.raises(ValueError, match="share memory"):
        opt.step()
