"""Fault injection for `mixprec.optim.AdamW`: copies and half-loaded state."""

from __future__ import annotations

import copy
import io
import math
import pickle
from typing import Any

import pytest
import torch

from mixprec.dtypes import ulp
from mixprec.optim import Adam, AdamW
from mixprec.optim.rng import step_key


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
    partial = copy.deepcopy(saved)
    first = min(partial["state"])
    del partial["state"][first]["exp_avg_sq"]  # a partial entry, unlike a missing one
    with pytest.raises(ValueError, match="do not match"):
        opt.load_state_dict(partial)
    bad_lr = copy.deepcopy(saved)
    bad_lr["param_groups"][0]["lr"] = -1.0
    with pytest.raises(ValueError, match="Invalid learning rate"):
        opt.load_state_dict(bad_lr)
    after = opt.state_dict()
    for pid, state in current["state"].items():
        for key, value in state.items():
            assert torch.equal(after["state"][pid][key], value), (pid, key)
    assert after["param_groups"] == current["param_groups"]


EDITS = {
    "prune": lambda w, mask: w.mul_(mask),
    "zero": lambda w, mask: w.zero_(),
    "reinit": lambda w, mask: torch.nn.init.normal_(w, std=0.02),
}


@pytest.mark.parametrize("master", ["exact", "remainder8", "kahan", "fp32"])
@pytest.mark.parametrize("edit", sorted(EDITS))
def test_in_place_edits_between_steps_never_decode_to_nan(master: str, edit: str) -> None:
    """Pruning half of a 4096-element bf16 weight under an exact master gave ~1000 NaN
    weights (a bf16 zero joined with a stale negative remainder)."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(64, 64).to(torch.bfloat16))
    opt = AdamW([w], lr=1e-3, master=master, fused=False)
    for seed in range(3):
        _grads([w], seed)
        opt.step()
    before = opt.master_weights()[0]
    mask = (torch.rand(64, 64, generator=torch.Generator().manual_seed(5)) > 0.5).to(w.dtype)
    with torch.no_grad():
        EDITS[edit](w, mask)
    masters = opt.master_weights()[0]
    assert torch.isfinite(masters).all()
    # The master becomes the edited parameter exactly (pruned elements exactly 0); the
    # elements an edit left alone lose their sub-bf16 part once, at most half an ulp.
    assert torch.equal(masters, w.detach().float())
    if edit == "prune":
        kept = mask.bool()
        distance = (masters[kept].double() - before[kept].double()).abs()
        assert (distance <= 0.5 * ulp(w.detach()[kept], torch.bfloat16)).all()
        assert (masters[~kept] == 0).all()
    _grads([w], 9)
    opt.step()
    assert torch.isfinite(w).all() and torch.isfinite(opt.master_weights()[0]).all()


def test_a_state_dict_saved_after_an_edit_is_synced() -> None:
    params, opt = _setup("exact", "fp32")
    _grads(params, 1)
    opt.step()
    with torch.no_grad():
        params[0].zero_()
    saved = copy.deepcopy(opt.state_dict())
    params2, opt2 = _setup("exact", "fp32")
    with torch.no_grad():
        for a, b in zip(params2, params, strict=True):
            a.copy_(b)
    opt2.load_state_dict(saved)
    assert torch.isfinite(opt2.master_weights()[0]).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_ulp_matches_nextafter(dtype: torch.dtype) -> None:
    info = torch.finfo(dtype)
    tiny = info.smallest_normal * info.eps  # the smallest subnormal
    values = torch.tensor(
        [0.0, 1.0, 1.5, 3.0, 1e-3, info.smallest_normal, 3 * tiny, info.max / 2], dtype=dtype
    )
    up = torch.nextafter(values, torch.full_like(values, math.inf))
    assert torch.equal(ulp(values, dtype), (up.double() - values.double()))


@pytest.mark.parametrize("fused", [False, True])
def test_int8_moments_survive_a_gradient_near_fp32s_range(fused: bool) -> None:
    """One gradient element of 1e21 made a block's v scale inf and two weights NaN;
    fp32 moments gave a finite step."""
    results = {}
    for moments in ("fp32", "int8"):
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(64, 64))
        opt = AdamW([w], lr=1e-3, moments=moments, min_int8_numel=256, fused=fused)
        for step in range(4):
            g = torch.randn(64, 64, generator=torch.Generator().manual_seed(step))
            if step == 1:
                g[3, 5] = 1e21
            w.grad = g
            opt.step()
            assert torch.isfinite(w).all(), (moments, step)
        results[moments] = w.detach().clone()
    assert opt.formats() == [("none", "int8")]
    # Away from the outlier's block, int8 tracks fp32 as usual.
    assert torch.allclose(results["int8"][8:], results["fp32"][8:], atol=5e-3)


@pytest.mark.parametrize("moments", ["int8", "int4"])
@pytest.mark.parametrize("rule", ["adamw", "amsgrad", "adam"])
@pytest.mark.parametrize("master", ["none", "remainder8"])  # remainder8: the bf16 loops
def test_a_gradient_whose_square_overflows_moves_no_weight_more_than_fp32_moments_do(
    moments: str, rule: str, master: str
) -> None:
    """A gradient element of +-1e36 (finite in bf16; its square overflows fp32) made every
    later step move its weight by about 1e12: the stored v was capped (int8's U_MAX,
    int4's V_MAX) while m kept 1e35. fp32 moments freeze that element (v is inf). Each
    step stays within a normal Adam step of lr * sqrt(1 - beta2**t) / (1 - beta1**t)
    times |m| / sqrt(v) <= 1 where v is capped (bf16 weights of 1e-2 round it by at most
    2**-14); the kernel and the reference agree."""
    weights = {}
    dtype = torch.float32 if master == "none" else torch.bfloat16
    kwargs: dict[str, Any] = {"lr": 1e-3, "master": master, "moments": moments}
    for fused in (False, True):
        torch.manual_seed(0)
        w = torch.nn.Parameter((torch.randn(64, 256) * 1e-2).to(dtype))
        opt = (
            Adam([w], **kwargs, min_int8_numel=256, fused=fused)
            if rule == "adam"
            else AdamW([w], **kwargs, amsgrad=rule == "amsgrad", min_int8_numel=256, fused=fused)
        )
        for step in range(6):
            g = torch.randn(64, 256, generator=torch.Generator().manual_seed(step)) * 1e-3
            if step == 2:
                g[3, 5], g[40, 200] = 1e36, -1e36
            w.grad = g.to(dtype)
            before = w.detach().float()
            opt.step()
            assert (w.detach().float() - before).abs().max() <= 2e-3, (fused, step)
        assert opt.formats() == [(master, moments)]
        weights[fused] = w.detach().clone()
    assert torch.equal(weights[False], weights[True])


def test_stochastic_rounding_noise_keeps_changing_past_2_to_the_24_steps() -> None:
    """The step counter was float32: from step 2**24 on every step drew the same noise."""
    w = torch.nn.Parameter(torch.randn(256).to(torch.bfloat16))
    opt = AdamW([w], lr=1e-3, master="stochastic", moments="fp32", fused=False, seed=3)
    w.grad = torch.ones_like(w)
    opt.step()  # state is made at the first step, as in torch
    opt.state[w]["step"].fill_(2**24 - 2)
    keys, counts = set(), []
    for _ in range(4):
        w.grad = torch.ones_like(w)
        opt.step()
        counts.append(int(opt.state[w]["step"].item()))
        keys.add(int(step_key(opt.state[w]["rng_seed"], opt.state[w]["step"])))
    assert counts == [2**24 - 1, 2**24, 2**24 + 1, 2**24 + 2]
    assert len(keys) == 4


@pytest.mark.parametrize(
    ("key", "value", "fragment"),
    [
        ("step", math.nan, "whole number"),
        ("step", -1.0, "whole number"),
        ("step", 2.5, "whole number"),
        ("exp_avg", math.nan, "inf/NaN"),
        ("exp_avg_sq", -1.0, "negative"),
        ("remainder_hi", None, None),  # any int8 pattern is a valid remainder
    ],
)
def test_state_values_no_step_could_write_are_refused(
    key: str, value: float | None, fragment: str | None
) -> None:
    """A NaN moment or a negative second moment loaded fine and reached the weights."""
    params, opt = _setup("exact", "fp32")
    _grads(params, 1)
    opt.step()
    state = copy.deepcopy(opt.state_dict())
    before = copy.deepcopy(state)
    if value is not None:
        state["state"][0][key].view(-1)[0] = value
    else:
        state["state"][0][key].view(-1)[0] = -128
    if fragment is None:
        opt.load_state_dict(state)
        return
    with pytest.raises(ValueError, match=fragment):
        opt.load_state_dict(state)
    after = opt.state_dict()
    for pid, st in before["state"].items():
        for k, v in st.items():
            assert torch.equal(after["state"][pid][k], v)


def test_state_for_unknown_parameters_is_refused() -> None:
    params, opt = _setup("exact", "fp32")
    _grads(params, 1)
    opt.step()
    state = copy.deepcopy(opt.state_dict())
    state["state"][99] = state["state"][0]
    with pytest.raises(ValueError, match="no group names"):
        opt.load_state_dict(state)


@pytest.mark.parametrize("eps", [0.0, -1e-8, math.nan, math.inf])
def test_eps_must_be_positive(eps: float) -> None:
    """eps=0 with a zero gradient gave 0/0 = NaN weights, reported as applied."""
    w = torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(ValueError, match="Invalid epsilon value"):
        AdamW([w], eps=eps)
    opt = AdamW([w])
    state = copy.deepcopy(opt.state_dict())
    state["param_groups"][0]["eps"] = eps
    with pytest.raises(ValueError, match="Invalid epsilon value"):
        opt.load_state_dict(state)


def test_a_parameter_without_saved_state_has_none_afterwards_as_in_torch() -> None:
    # torch's state dicts leave out parameters that never had a gradient (frozen ones).
    params, opt = _setup("exact", "fp32")
    _grads(params, 1)
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    last = max(saved["state"])
    del saved["state"][last]
    opt.load_state_dict(saved)
    assert len(opt.state) == len(saved["state"])
    assert (
        opt.param_groups[-1]["params"][-1] not in opt.state
        or not opt.state[opt.param_groups[-1]["params"][-1]]
    )


@pytest.mark.parametrize("master", ["exact", "remainder8", "kahan", "fp32"])
def test_loading_other_weights_makes_the_master_those_weights(master: str) -> None:
    """Found by review: after model.load_state_dict(other), exact/remainder8/kahan masters
    kept the old remainders (up to half an ulp off, every element), and a zero-update
    kahan step then moved weights."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(64, 64).to(torch.bfloat16))
    opt = AdamW([w], lr=1e-3, master=master, fused=False)
    for seed in range(3):
        _grads([w], seed)
        opt.step()
    other = torch.randn(64, 64).to(torch.bfloat16)
    with torch.no_grad():
        w.copy_(other)  # what nn.Module.load_state_dict does
    assert torch.equal(opt.master_weights()[0], other.float())
    for group in opt.param_groups:
        group["lr"] = 0.0
    w.grad = torch.zeros_like(w)
    opt.step()
    assert torch.equal(w.detach(), other)
    assert torch.equal(opt.master_weights()[0], other.float())


_EMPTIED_STATE = """
import torch
from mixprec.optim import AdamW, native

native.library()
for master in ("exact", "fp32", "kahan", "remainder8"):
    for moments in ("fp32", "int8"):
        p = torch.nn.Parameter(torch.randn(4096).bfloat16())
        opt = AdamW([p], master=master, moments=moments, fused=True)
        p.grad = torch.randn_like(p)
        opt.step()
        for key in list(opt.state[p]):
            if key == "step" or not opt.state[p][key].numel():
                continue
            saved = {k: v.clone() for k, v in opt.state[p].items()}
            before = p.detach().clone()
            opt.state[p][key].set_()  # emptied in place: no elements, no memory
            try:
                opt.step()
                print("stepped", master, moments, key)
            except (ValueError, RuntimeError):
                pass
            assert torch.equal(p.detach(), before), (master, moments, key)
            for k, v in saved.items():
                if k != key:
                    assert torch.equal(opt.state[p][k], v), (master, moments, key, k)
            opt.state[p][key] = saved[key]
print("ok")
"""


DELETED = object()  # an edit that deletes the key


def _stepped_once_then(
    edit: Any, master: str, *, fused: bool
) -> tuple[list[torch.nn.Parameter], AdamW]:
    """Two bf16 parameters stepped once, then `edit` applied to the second one's state."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, 64).bfloat16()) for _ in range(2)]
    opt = AdamW(params, lr=1e-2, master=master, fused=fused, seed=7)
    _grads(params, 1)
    opt.step()
    edit(opt.state[params[1]])
    return params, opt


@pytest.mark.parametrize("fused", [True, False])
def test_a_parameter_re_pointed_by_set_is_followed_or_refused_by_name(fused: bool) -> None:
    """Found by review: `p.set_(t)` to another shape raised torch's bare "The size of
    tensor a (4) must match the size of tensor b (8)" from the master's reset."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(8, 4).bfloat16())
    opt = AdamW([p], lr=1e-2, master="exact", fused=fused)
    p.grad = torch.randn(8, 4).bfloat16()
    opt.step()
    new = torch.randn(4, 8).bfloat16()
    with torch.no_grad():
        p.set_(new.clone())  # the same size, another shape: followed
    p.grad = torch.zeros(4, 8).bfloat16()
    opt.step()
    assert opt.master_weights()[0].shape == (4, 8)
    with torch.no_grad():
        p.set_(torch.randn(4, 4).bfloat16())  # another size: refused, by name
    p.grad = torch.zeros(4, 4).bfloat16()
    before = p.detach().clone()
    with pytest.raises(ValueError, match=r"state\['remainder_hi'\] holds 32 elements"):
        opt.step()
    assert torch.equal(p.detach(), before)
