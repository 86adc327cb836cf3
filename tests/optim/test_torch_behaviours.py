"""Generic optimizer behaviours torch tests for every optimizer (its ``TestOptimRenewed``),
on each of mixprec's optimizers.

A port of what a drop-in must keep: step hooks, state-dict hooks, `add_param_group`,
`zero_grad`, closures, schedulers (momentum cycled by ``OneCycleLR`` included), deepcopy,
loading a state dict into a fresh optimizer (named parameters, torch's older group forms,
a ``step`` saved as a number, parameter ids in another order) and a ``weights_only``
round trip, each continuing identically.
"""

from __future__ import annotations

import copy
import functools
import io
from collections.abc import Callable

import pytest
import torch

from mixprec.optim import SGD, Adam, AdamW, Lion
from mixprec.optim.rule_optimizer import RuleOptimizer

Make = Callable[..., RuleOptimizer]

#: Each optimizer and update rule, as a constructor taking params (and keyword overrides).
OPTIMIZERS: dict[str, Make] = {
    "adamw": functools.partial(AdamW, lr=1e-2),
    "adamw-amsgrad": functools.partial(AdamW, lr=1e-2, amsgrad=True),
    "adam": functools.partial(Adam, lr=1e-2, weight_decay=0.1),
    "sgd": functools.partial(SGD, lr=1e-2),
    "sgd-momentum": functools.partial(SGD, lr=1e-2, momentum=0.9, dampening=0.1),
    "sgd-nesterov": functools.partial(SGD, lr=1e-2, momentum=0.9, nesterov=True),
    "lion": functools.partial(Lion, lr=1e-3, weight_decay=0.1),
}
each = pytest.mark.parametrize("make", list(OPTIMIZERS.values()), ids=list(OPTIMIZERS))

#: torch's counterpart of each (Lion has none), with the same options.
TORCH_TWINS: dict[str, Make] = {
    "adamw": functools.partial(torch.optim.AdamW, lr=1e-2),
    "adamw-amsgrad": functools.partial(torch.optim.AdamW, lr=1e-2, amsgrad=True),
    "adam": functools.partial(torch.optim.Adam, lr=1e-2, weight_decay=0.1),
    "sgd": functools.partial(torch.optim.SGD, lr=1e-2),
    "sgd-momentum": functools.partial(torch.optim.SGD, lr=1e-2, momentum=0.9, dampening=0.1),
    "sgd-nesterov": functools.partial(torch.optim.SGD, lr=1e-2, momentum=0.9, nesterov=True),
}


def _params() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(4, 6)), torch.nn.Parameter(torch.randn(6))]


def _fill_grads(params: list[torch.nn.Parameter], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)


def _clone(params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def _steps(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], seeds: range) -> None:
    for seed in seeds:
        _fill_grads(params, seed)
        opt.step()


def _equal(a: list[torch.nn.Parameter], b: list[torch.nn.Parameter]) -> None:
    for p, q in zip(a, b, strict=True):
        assert torch.equal(p, q)


@each
def test_step_and_state_dict_hooks_run_in_order(make: Make) -> None:
    params = _params()
    opt = make(params)
    calls: list[str] = []
    handle = opt.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
    opt.register_step_post_hook(lambda o, a, k: calls.append("post"))
    opt.register_state_dict_pre_hook(lambda o: calls.append("sd-pre"))
    opt.register_state_dict_post_hook(lambda o, sd: calls.append("sd-post") or sd)
    opt.register_load_state_dict_pre_hook(lambda o, sd: calls.append("load-pre") or sd)
    opt.register_load_state_dict_post_hook(lambda o: calls.append("load-post"))
    _steps(opt, params, range(1))
    opt.load_state_dict(opt.state_dict())
    assert calls == ["pre", "post", "sd-pre", "sd-post", "load-pre", "load-post"]
    handle.remove()
    _steps(opt, params, range(1, 2))
    assert calls[-1] == "post" and calls.count("pre") == 1


@each
def test_state_dict_hooks_may_edit_what_is_saved_and_loaded(make: Make) -> None:
    """torch's hook tests: a pre hook writes a non-tensor into ``state``, a post hook
    removes it; load pre hooks edit or replace the dict, ``prepend`` runs one first."""
    params = _params()
    opt = make(params)
    _steps(opt, params, range(2))
    opt.register_state_dict_pre_hook(lambda o: o.state.__setitem__("test", 1))
    assert opt.state_dict()["state"]["test"] == 1

    def drop_test(o: torch.optim.Optimizer, sd: dict[str, object]) -> dict[str, object]:
        sd["ran"] = sd["state"].pop("test", None) is not None  # type: ignore[attr-defined]
        return sd

    opt.register_state_dict_post_hook(drop_test)
    saved = opt.state_dict()
    assert "test" not in saved["state"] and saved["ran"]
    del opt.state["test"]

    def set_lr(value: float) -> Callable[..., object]:
        def hook(o: torch.optim.Optimizer, sd: dict[str, object]) -> None:
            sd["param_groups"][0]["lr"] = value  # type: ignore[index]

        return hook

    def replace(o: torch.optim.Optimizer, sd: dict[str, object]) -> dict[str, object]:
        mine = copy.deepcopy(sd)
        mine["param_groups"][0]["lr"] = 0.003  # type: ignore[index]
        return mine

    again = make(_clone(params))
    again.register_load_state_dict_pre_hook(set_lr(0.002))
    again.load_state_dict(copy.deepcopy(saved))
    assert again.param_groups[0]["lr"] == 0.002
    again.register_load_state_dict_pre_hook(replace, prepend=True)
    again.load_state_dict(copy.deepcopy(saved))
    assert again.param_groups[0]["lr"] == 0.002  # the prepended hook ran first
    again.register_load_state_dict_post_hook(lambda o: o.state.__setitem__("loaded", True))
    again.load_state_dict(copy.deepcopy(saved))
    assert again.state["loaded"] is True


@each
def test_closure_zero_grad_and_add_param_group(make: Make) -> None:
    params = _params()
    opt = make(params[:1])
    opt.add_param_group({"params": params[1:], "lr": 1e-3, "weight_decay": 0.0})
    assert [g["lr"] for g in opt.param_groups] == [opt.defaults["lr"], 1e-3]

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = sum(p.pow(2).sum() for p in params)
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor)
    assert all(float(opt.state[p]["step"]) == 1.0 for p in params)
    opt.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in params)
    opt.zero_grad(set_to_none=False)  # no grads to zero: stays None, as in torch
    before = [p.detach().clone() for p in params]
    opt.step()  # no gradients: a step changes nothing
    _equal(params, before)  # type: ignore[arg-type]


@each
def test_a_weights_only_round_trip_into_a_fresh_optimizer_continues_identically(
    make: Make,
) -> None:
    params = _params()
    opt = make(params, master="auto")
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    for seed in range(3):
        _steps(opt, params, range(seed, seed + 1))
        sched.step()
    buf = io.BytesIO()
    torch.save({"opt": opt.state_dict(), "sched": sched.state_dict(), "params": params}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    params2 = _clone(saved["params"])
    opt2 = make(params2, master="auto")
    sched2 = torch.optim.lr_scheduler.CosineAnnealingLR(opt2, T_max=10)
    opt2.load_state_dict(saved["opt"])
    sched2.load_state_dict(saved["sched"])
    twin, twin_sched = copy.deepcopy((opt, sched))  # a deepcopy steps like the original too
    twin_params = [p for g in twin.param_groups for p in g["params"]]
    for seed in range(3, 6):
        for ps, o, s in ((params, opt, sched), (params2, opt2, sched2)):
            _steps(o, ps, range(seed, seed + 1))
            s.step()
        _steps(twin, twin_params, range(seed, seed + 1))
        twin_sched.step()
    _equal(params, params2)
    _equal(params, twin_params)
    assert opt.param_groups[0]["lr"] == opt2.param_groups[0]["lr"]
    plain = make(_clone(params))  # torch's deepcopy test: no scheduler wrapping `step`
    _steps(plain, [p for g in plain.param_groups for p in g["params"]], range(2))
    public = {k for k in vars(plain) if not k.startswith("_")}
    assert public == {k for k in vars(copy.deepcopy(plain)) if not k.startswith("_")}


@each
@pytest.mark.parametrize("named", [False, True], ids=["params", "named"])
def test_state_dict_loading_is_deterministic(make: Make, named: bool) -> None:
    """torch's ``test_state_dict_deterministic``: a fresh optimizer loading the state dict
    (named parameters or not) steps bitwise like the original, and saves the same dict."""
    params = _params()
    x = torch.randn(6)

    def closure(opt: torch.optim.Optimizer, ps: list[torch.nn.Parameter]) -> torch.Tensor:
        opt.zero_grad()
        loss = (ps[0].mv(x) + ps[1][:4]).pow(2).sum()
        loss.backward()
        return loss

    opt = make([(f"p{i}", p) for i, p in enumerate(params)] if named else params)
    for _ in range(5):
        opt.step(functools.partial(closure, opt, params))
    copies = _clone(params)
    opt_c = make(copies)
    opt_c.load_state_dict(copy.deepcopy(opt.state_dict()))
    for _ in range(5):
        opt.step(functools.partial(closure, opt, params))
        opt_c.step(functools.partial(closure, opt_c, copies))
        _equal(params, copies)
    ours, theirs = opt.state_dict(), opt_c.state_dict()
    for group in ours["param_groups"] + theirs["param_groups"]:  # names are optional
        group.pop("param_names", None)
    assert ours["param_groups"] == theirs["param_groups"]
    for pid, state in ours["state"].items():
        assert state.keys() == theirs["state"][pid].keys()
        assert all(torch.equal(v, theirs["state"][pid][k]) for k, v in state.items())


@each
def test_a_parameter_in_two_groups_is_refused_at_the_state_dict(make: Make) -> None:
    """torch's deterministic test repeats the groups (``param_groups.extend``) and
    saves: every parameter then sits in two groups, which mixprec refuses at each
    boundary (a parameter is stepped by one group), in one line."""
    params = _params()
    opt = make(params)
    _steps(opt, params, range(1))
    opt.param_groups.extend(opt.param_groups)
    with pytest.raises(ValueError, match="two param groups") as info:
        opt.state_dict()
    assert "\n" not in str(info.value)


@each
def test_parameter_ids_in_another_order_load_by_position(make: Make) -> None:
    """torch matches saved ids to parameters by position in each group, whatever the
    numbers (a state dict written with the groups in another order numbers them so)."""
    params = _params()
    opt = make([{"params": params[:1]}, {"params": params[1:], "lr": 2e-3}])
    _steps(opt, params, range(2))
    saved = copy.deepcopy(opt.state_dict())
    renumber = {0: 7, 1: 3}
    saved["state"] = {renumber[k]: v for k, v in saved["state"].items()}
    for group in saved["param_groups"]:
        group["params"] = [renumber[i] for i in group["params"]]
    copies = _clone(params)
    again = make([{"params": copies[:1]}, {"params": copies[1:]}])
    again.load_state_dict(saved)
    assert again.param_groups[1]["lr"] == 2e-3
    _steps(opt, params, range(2, 4))
    _steps(again, copies, range(2, 4))
    _equal(params, copies)


@each
def test_torchs_older_group_forms_and_a_numeric_step_load(make: Make) -> None:
    """torch's ``test_can_load_older_state_dict`` (flags added since deleted from the
    groups) and ``test_load_nontensor_step`` (``step`` saved as a Python number)."""
    params = _params()
    opt = make(params)
    _steps(opt, params, range(3))
    old = copy.deepcopy(opt.state_dict())
    for group in old["param_groups"]:
        for flag in ("foreach", "differentiable", "fused", "maximize", "capturable"):
            group.pop(flag, None)
    for state in old["state"].values():
        state["step"] = state["step"].item()
    copies = _clone(params)
    again = make(copies)
    again.load_state_dict(old)
    assert again.last_conversion is not None and again.last_conversion.converted
    _steps(opt, params, range(3, 5))
    _steps(again, copies, range(3, 5))
    _equal(params, copies)


@each
def test_a_near_zero_lr_group_stays_put_while_the_other_learns(make: Make) -> None:
    """torch's ``test_param_groups_lr`` and ``test_step_is_noop_for_zero_grads``."""
    weight, bias = torch.nn.Parameter(torch.randn(10, 5)), torch.nn.Parameter(torch.randn(10))
    irrelevant = torch.nn.Parameter(torch.randn(2))
    before = irrelevant.detach().clone()
    x = torch.randn(5)
    lr = make([weight]).defaults["lr"]
    opt = make([{"params": [weight, bias], "lr": lr}, {"params": [irrelevant]}], lr=1e-28)
    first = float((weight.mv(x) + bias).pow(2).sum().detach())
    for _ in range(20):
        opt.zero_grad()
        loss = (weight.mv(x) + bias).pow(2).sum()
        loss.backward()
        irrelevant.grad = torch.rand_like(irrelevant)
        opt.step()
    assert float(loss.detach()) < first
    assert torch.equal(irrelevant, before)
    p = torch.nn.Parameter(torch.randn(5, 1))
    start = p.detach().clone()
    still = make([p], weight_decay=0.0, lr=1e-5)
    p.grad = torch.zeros_like(p)
    still.step()
    assert torch.equal(p, start)


@pytest.mark.parametrize("name", [name for name in TORCH_TWINS if name != "sgd"])
def test_one_cycle_lr_drives_it_as_it_drives_torchs(name: str) -> None:
    """``OneCycleLR`` cycles the learning rate and the momentum (SGD's ``momentum``,
    Adam's ``betas[0]``): each step reads the group as the scheduler left it (plain SGD
    refuses a momentum: the next test)."""
    params = _params()
    copies = _clone(params)
    ours, theirs = OPTIMIZERS[name](params), TORCH_TWINS[name](copies)
    scheds = [
        torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=8) for o in (ours, theirs)
    ]
    for seed in range(8):
        for o, ps, s in ((ours, params, scheds[0]), (theirs, copies, scheds[1])):
            _steps(o, ps, range(seed, seed + 1))
            s.step()
    key = "momentum" if "sgd" in name else "betas"
    assert ours.param_groups[0][key] == theirs.param_groups[0][key]
    for p, q in zip(params, copies, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)


def test_a_momentum_set_on_a_group_made_without_one_is_refused_in_one_line() -> None:
    """A group made with momentum=0 keeps no buffer: ``OneCycleLR`` setting a momentum
    on it is refused at the step (with the way out), not stepped as plain SGD."""
    params = _params()
    opt = SGD(params, lr=1e-2)
    torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=8)
    assert opt.param_groups[0]["momentum"] > 0
    before = [p.detach().clone() for p in params]
    _fill_grads(params, 0)
    with pytest.raises(ValueError, match=r"added with momentum=0.*momentum > 0") as info:
        opt.step()
    assert "\n" not in str(info.value)
    _equal(params, before)  # type: ignore[arg-type]


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


@pytest.mark.parametrize("name", list(TORCH_TWINS))
def test_parameters_put_into_param_groups_by_hand_are_stepped_as_torch_steps_them(
    name: str,
) -> None:
    """torch's optimizers step a parameter appended to ``group["params"]`` (its state is
    made at its first step); ours raised a KeyError showing the tensor."""
    params = _params()
    opt, ref = OPTIMIZERS[name](params[:1]), TORCH_TWINS[name](_clone(params[:1]))
    extra = [torch.nn.Parameter(params[1].detach().clone()) for _ in range(2)]
    opt.param_groups[0]["params"].append(extra[0])
    ref.param_groups[0]["params"].append(extra[1])
    assert opt.formats() == [("none", "fp32")] * 2  # planned before any step
    assert len(opt.master_weights()) == 2
    ref_first = ref.param_groups[0]["params"][0]
    for step in range(3):
        _fill_grads([params[0], extra[0]], step)
        opt.step()
        _fill_grads([ref_first, extra[1]], step)
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


@pytest.mark.parametrize("name", list(TORCH_TWINS))
def test_building_it_leaves_torchs_random_stream_alone(name: str) -> None:
    """Swapping torch's optimizer for this one must not change later random draws (the
    default stochastic-rounding seed was drawn from torch's generator, advancing it)."""
    draws = []
    for build in (TORCH_TWINS[name], OPTIMIZERS[name]):
        torch.manual_seed(0)
        build(_params())
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


def test_a_momentum_group_scheduled_to_zero_is_refused_not_stepped_unlike_torch() -> None:
    """Found by review: a group added with a momentum and set to momentum=0 stepped
    (1 - dampening) * g and overwrote its buffer; torch steps g and keeps the buffer.
    Such a schedule is refused in one line, nothing stepped."""
    params = _params()
    opt = SGD(params, lr=1e-2, momentum=0.9, dampening=0.5)
    _steps(opt, params, range(1))
    before = [p.detach().clone() for p in params]
    opt.param_groups[0]["momentum"] = 0.0
    _fill_grads(params, 5)
    with pytest.raises(ValueError, match="momentum=0, but the group was added with a momentum"):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(params, before, strict=True))
