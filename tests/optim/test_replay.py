"""Prepared native steps (`mixprec.optim.replay`): replayed while valid, retired on change.

Every case runs the same events on a native optimizer (which replays its
prepared step) and on an eager one (``fused=False``, which never prepares):
both must stay bitwise equal. Each event also pins which path the native
optimizer's next step takes: a replay (no `step_many` call) when nothing the
table depends on changed, the full path (and a new preparation) when
something did.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

from mixprec.optim import AdamW, native

try:
    native.library()
    HAVE_NATIVE = True
except native.NativeUnavailableError:  # pragma: no cover - machines without a compiler
    HAVE_NATIVE = False

pytestmark = pytest.mark.skipif(not HAVE_NATIVE, reason="no native kernel")

# bf16 tensors take the group's master; the fp32 one is its own (a second family and call).
SHAPES: list[tuple[tuple[int, ...], torch.dtype]] = [
    ((5, 7), torch.bfloat16),
    ((64,), torch.bfloat16),
    ((3, 4), torch.bfloat16),
    ((6,), torch.float32),
]

Params = list[torch.Tensor]
Event = Callable[[AdamW, Params, int], None]


def _params() -> Params:
    gen = torch.Generator().manual_seed(0)
    return [
        torch.nn.Parameter((torch.randn(shape, generator=gen) * 0.5).to(dtype))
        for shape, dtype in SHAPES
    ]


def _set_grads(params: Params, step: int) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=gen) * 1e-2).to(p.dtype)


def _same(a: Params, a_opt: AdamW, b: Params, b_opt: AdamW) -> None:
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x.detach().view(-1), y.detach().view(-1))
        assert a_opt.state[x].keys() == b_opt.state[y].keys()
        for key, value in a_opt.state[x].items():
            assert torch.equal(value, b_opt.state[y][key]), key


def _grads_in_place(opt: AdamW, params: Params, step: int) -> None:
    gen = torch.Generator().manual_seed(300 + step)
    for p in params:
        assert p.grad is not None
        p.grad.add_((torch.randn(p.shape, generator=gen) * 1e-3).to(p.dtype))


def _edit_param(opt: AdamW, params: Params, step: int) -> None:
    with torch.no_grad():
        params[0].mul_(0.5)


def _assign_data(opt: AdamW, params: Params, step: int) -> None:
    params[1].data = params[1].data * 2


def _lr(opt: AdamW, params: Params, step: int) -> None:
    opt.param_groups[0]["lr"] = 3e-2


def _maximize(opt: AdamW, params: Params, step: int) -> None:
    opt.param_groups[0]["maximize"] = True


def _grad_none(opt: AdamW, params: Params, step: int) -> None:
    params[2].grad = None


def _grad_fp32(opt: AdamW, params: Params, step: int) -> None:
    p = params[0]
    assert p.grad is not None
    p.grad_dtype = None  # type: ignore[attr-defined]
    p.grad = p.grad.float()


def _grad_strided(opt: AdamW, params: Params, step: int) -> None:
    p = params[0]
    assert p.grad is not None
    p.grad = p.grad.t().contiguous().t()  # same values, not contiguous


def _replace_state(opt: AdamW, params: Params, step: int) -> None:
    state = opt.state[params[1]]
    state["exp_avg"] = state["exp_avg"] * 0.5


def _replace_state_dict(opt: AdamW, params: Params, step: int) -> None:
    opt.state[params[1]] = {k: v.clone() for k, v in opt.state[params[1]].items()}


def _zero_state_in_place(opt: AdamW, params: Params, step: int) -> None:
    opt.state[params[1]]["exp_avg_sq"].zero_()


def _repoint_state_data(opt: AdamW, params: Params, step: int) -> None:
    state = opt.state[params[1]]
    state["exp_avg"].data = state["exp_avg"].clone()  # same object, other memory


def _repoint_state_set(opt: AdamW, params: Params, step: int) -> None:
    state = opt.state[params[1]]
    state["exp_avg_sq"].set_(state["exp_avg_sq"].clone())


def _state_viewed_as_int32(opt: AdamW, params: Params, step: int) -> None:
    state = opt.state[params[1]]
    state["exp_avg"].data = state["exp_avg"].data.view(torch.int32)  # same memory and size


def _state_transposed_in_place(opt: AdamW, params: Params, step: int) -> None:
    t = opt.state[params[0]]["exp_avg_sq"]  # (5, 7): same memory and size, transposed
    t.set_(t.untyped_storage(), 0, (7, 5), (1, 7))


def _load(opt: AdamW, params: Params, step: int) -> None:
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))


def _read_views(opt: AdamW, params: Params, step: int) -> None:
    opt.state_dict()
    opt.master_weights()


def _new_group(opt: AdamW, params: Params, step: int) -> None:
    p = torch.nn.Parameter(torch.linspace(-1, 1, 10).to(torch.bfloat16))
    params.append(p)
    opt.add_param_group({"params": [p], "weight_decay": 0.0})


def _groups_copied(opt: AdamW, params: Params, step: int) -> None:
    opt.param_groups = [dict(group) for group in opt.param_groups]  # equal dicts, new objects


def _group_replaced_in_list(opt: AdamW, params: Params, step: int) -> None:
    opt.param_groups[0] = dict(opt.param_groups[0])


def _param_put_in_by_hand(opt: AdamW, params: Params, step: int) -> None:
    p = torch.nn.Parameter(torch.linspace(-1, 1, 10).to(torch.bfloat16))
    params.append(p)
    opt.param_groups[0]["params"].append(p)  # as torch allows: state made at its first step


# (event, whether the next step replays the prepared group, applied to grads after they
# are set for the step rather than before)
EVENTS: dict[str, tuple[Event | None, bool, bool]] = {
    "new gradients": (None, True, False),
    "gradients accumulated in place": (_grads_in_place, True, True),
    "learning rate changed": (_lr, True, False),
    "state zeroed in place": (_zero_state_in_place, True, False),
    "state_dict and master_weights read": (_read_views, True, False),
    "parameter edited in place": (_edit_param, False, False),
    "parameter data assigned": (_assign_data, False, False),
    "maximize turned on": (_maximize, False, False),
    "a gradient is None": (_grad_none, False, True),
    "a gradient in fp32": (_grad_fp32, False, True),
    "a gradient not contiguous": (_grad_strided, False, True),
    "a state entry replaced": (_replace_state, False, False),
    "a state dict replaced": (_replace_state_dict, False, False),
    "a state tensor re-pointed (.data =)": (_repoint_state_data, False, False),
    "a state tensor re-pointed (set_)": (_repoint_state_set, False, False),
    "state loaded": (_load, False, False),
    "a group added": (_new_group, False, False),
    "the group dicts replaced by equal copies": (_groups_copied, False, False),
    "a group dict replaced in the list": (_group_replaced_in_list, False, False),
    "a parameter put into a group by hand": (_param_put_in_by_hand, False, False),
}


@pytest.mark.parametrize("master", ["exact", "kahan", "stochastic"])
@pytest.mark.parametrize("name", list(EVENTS))
def test_replayed_steps_equal_the_full_path_through_each_change(
    master: str, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    event, replays, after_grads = EVENTS[name]
    calls: list[int] = []
    original = native.NativeLibrary.step_many

    def counting(self: native.NativeLibrary, **kw: Any) -> None:
        calls.append(len(kw["params"]))
        original(self, **kw)

    monkeypatch.setattr(native.NativeLibrary, "step_many", counting)
    ours_p, ref_p = _params(), _params()
    hyper = {"lr": 1e-2, "weight_decay": 0.1, "master": master, "seed": 0}
    ours, ref = AdamW(ours_p, fused=True, **hyper), AdamW(ref_p, fused=False, **hyper)
    for step in range(6):
        for params, opt in ((ours_p, ours), (ref_p, ref)):
            if event is not None and step == 3 and not after_grads:
                event(opt, params, step)
            _set_grads(params, step)
            if event is not None and step == 3 and after_grads:
                event(opt, params, step)
        calls.clear()
        ours.step()
        ref.step()
        _same(ours_p, ours, ref_p, ref)
        if step == 0:
            assert calls == [3, 1]  # two families: the full path, then prepared
        elif step == 3:
            assert (calls == []) is replays, calls
        elif step in (1, 2):
            assert calls == [], calls  # replayed
    for a, b in zip(ours.master_weights(), ref.master_weights(), strict=True):
        assert torch.equal(a, b)


def test_the_first_replay_after_an_edit_keeps_the_masters_it_replayed() -> None:
    # The versions the replays leave live in the prepared group until the full path
    # needs them: had they not been recorded, this fallback would take every replayed
    # step's write for an edit and reset the exact masters to the bf16 values.
    ours_p, ref_p = _params(), _params()
    ours = AdamW(ours_p, fused=True, master="exact", lr=1e-2)
    ref = AdamW(ref_p, fused=False, master="exact", lr=1e-2)
    for step in range(5):
        for params, opt in ((ours_p, ours), (ref_p, ref)):
            _set_grads(params, step)
            if step == 4:
                params[3].grad = None  # the group's set of gradients changed: full path
            opt.step()
    for a, b in zip(ours.master_weights(), ref.master_weights(), strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(ours.master_weights()[0], ours_p[0].float())


def test_a_copy_made_after_replays_steps_its_own_state() -> None:
    params = _params()
    opt = AdamW(params, fused=True)
    for step in range(3):
        _set_grads(params, step)
        opt.step()
    assert opt._prepared  # replaying
    twin = copy.deepcopy(opt)
    twin_params = [p for g in twin.param_groups for p in g["params"]]
    before = [opt.state[p]["exp_avg"].clone() for p in params]
    for step in range(3, 5):
        _set_grads(twin_params, step)
        twin.step()
    assert [int(twin.state[p]["step"]) for p in twin_params] == [5] * 4
    assert [int(opt.state[p]["step"]) for p in params] == [3] * 4
    for p, b in zip(params, before, strict=True):
        assert torch.equal(opt.state[p]["exp_avg"], b)


def test_a_replaced_step_counter_is_checked_on_replay() -> None:
    params = _params()
    opt = AdamW(params, fused=True)
    for step in range(2):
        _set_grads(params, step)
        opt.step()
    opt.state[params[0]]["step"].fill_(-1.0)  # in place: the replay's own table reads it
    _set_grads(params, 2)
    with pytest.raises(ValueError, match="step counter"):
        opt.step()


def test_a_profiled_step_goes_through_the_operator() -> None:
    params = _params()
    opt = AdamW(params, fused=True)
    for step in range(2):
        _set_grads(params, step)
        opt.step()
    _set_grads(params, 2)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        opt.step()
    assert [e.name for e in prof.events()].count("mixprec::adamw_step_") == 2


def test_replays_bump_the_parameters_versions() -> None:
    params = _params()
    opt = AdamW(params, fused=True)
    for step in range(2):
        _set_grads(params, step)
        opt.step()
    before = [p._version for p in params]
    _set_grads(params, 2)
    opt.step()
    assert [p._version for p in params] == [v + 1 for v in before]


@pytest.mark.parametrize("event", [_state_viewed_as_int32, _state_transposed_in_place])
def test_a_state_tensor_changed_in_dtype_or_layout_in_place_is_refused_as_by_the_full_path(
    event: Event,
) -> None:
    """Same memory and size, another dtype or a transposed layout: the replay's table
    would read it wrongly; the full path refuses it, and so does the step now."""
    params = _params()
    opt = AdamW(params, fused=True, lr=1e-2, master="exact", seed=0)
    for step in range(3):
        _set_grads(params, step)
        opt.step()
    event(opt, params, 3)
    _set_grads(params, 3)
    before = [p.detach().clone() for p in params]
    with pytest.raises(ValueError, match=r"state\['exp_avg(_sq)?'\] is (torch.int32|not laid out)"):
        opt.step()
    assert all(torch.equal(a, p.detach()) for a, p in zip(before, params, strict=True))
