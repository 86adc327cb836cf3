"""Migrating in from torch.optim.AdamW, older mixprec forms, and exporting back to torch."""

from __future__ import annotations

import copy
import io

import pytest
import torch

from mixprec.optim import SGD, Adam, AdamW, Lion
from mixprec.optim.state_dicts import TORCH_FORMS

TOLERANCE = 1e-6


def _params(seed: int = 0, dtype: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
    torch.manual_seed(seed)
    return [
        torch.nn.Parameter(torch.randn(64, 128).to(dtype)),  # 8192 elements: int8-eligible
        torch.nn.Parameter(torch.randn(7).to(dtype)),
    ]


def _grads(step: int, params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=gen).to(p.dtype) for p in params]


def _run(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], steps: range) -> None:
    for step in steps:
        for p, g in zip(params, _grads(step, params), strict=True):
            p.grad = g
        opt.step()


def _roundtrip(sd: dict[str, object]) -> dict[str, object]:
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_a_torch_adamw_run_continues_here_within_tolerance() -> None:
    ref_params, our_params = _params(), _params()
    ref = torch.optim.AdamW(
        [{"params": ref_params[:1]}, {"params": ref_params[1:], "weight_decay": 0.0}], lr=1e-2
    )
    _run(ref, ref_params, range(3))
    saved = _roundtrip(ref.state_dict())
    for p, q in zip(our_params, ref_params, strict=True):
        p.data.copy_(q.data)
    ours = AdamW([{"params": our_params[:1]}, {"params": our_params[1:], "weight_decay": 0.0}])
    ours.load_state_dict(saved)
    assert ours.last_conversion is not None
    assert ours.last_conversion.source == "torch.optim.AdamW"
    assert ours.last_conversion.params == 2
    assert "converting 2 parameter(s)" in ours.last_conversion.describe()
    assert ours.param_groups[0]["lr"] == 1e-2 and ours.param_groups[1]["weight_decay"] == 0.0
    _run(ref, ref_params, range(3, 6))
    _run(ours, our_params, range(3, 6))
    for p, q in zip(our_params, ref_params, strict=True):
        torch.testing.assert_close(p, q, atol=TOLERANCE, rtol=TOLERANCE)


def test_a_torch_state_dict_is_converted_into_bf16_masters_and_int8_moments() -> None:
    ref_params = _params()
    ref = torch.optim.AdamW(ref_params, lr=1e-3)
    _run(ref, ref_params, range(2))
    params = _params(dtype=torch.bfloat16)
    for p, q in zip(params, ref_params, strict=True):
        p.data.copy_(q.data)
    ours = AdamW(params, master="exact", moments="int8")
    ours.load_state_dict(ref.state_dict())
    conv = ours.last_conversion
    assert conv is not None
    assert conv.moments == {"int8": 1, "fp32": 1}  # the 7-element tensor keeps fp32 moments
    assert conv.masters_from_params == 2
    state = ours.state[params[0]]
    assert float(state["step"]) == 2.0 and state["step"].dtype == torch.float64
    m, v = ref.state[ref_params[0]]["exp_avg"], ref.state[ref_params[0]]["exp_avg_sq"]
    back = ours.torch_state_dict()["state"][0]
    assert torch.allclose(back["exp_avg"].float(), m, rtol=0.05, atol=1e-3 * m.abs().max())
    assert torch.allclose(back["exp_avg_sq"].float(), v, rtol=0.1, atol=1e-3 * v.abs().max())


def test_the_export_loads_into_torch_and_continues_alike() -> None:
    ours_params, ref_params = _params(), _params()
    ours = AdamW(ours_params, lr=1e-2, weight_decay=0.05)
    _run(ours, ours_params, range(4))
    exported = _roundtrip(ours.torch_state_dict())
    for p, q in zip(ref_params, ours_params, strict=True):
        p.data.copy_(q.data)
    ref = torch.optim.AdamW(ref_params)
    ref.load_state_dict(exported)
    _run(ours, ours_params, range(4, 7))
    _run(ref, ref_params, range(4, 7))
    for p, q in zip(ours_params, ref_params, strict=True):
        torch.testing.assert_close(p, q, atol=TOLERANCE, rtol=TOLERANCE)


def test_older_forms_of_its_own_load_and_say_so() -> None:
    params = _params()
    ours = AdamW(params, lr=1e-2)
    _run(ours, params, range(2))
    sd = ours.state_dict()
    for group in sd["param_groups"]:
        del group["maximize"]
    for state in sd["state"].values():
        state["step"] = float(state["step"])
    again = AdamW(_params(), lr=1e-2)
    again.load_state_dict(sd)
    assert again.last_conversion is not None
    assert again.last_conversion.source == "mixprec.optim.AdamW (older form)"
    assert again.param_groups[0]["maximize"] is False
    assert again.state[again.param_groups[0]["params"][0]]["step"].dtype == torch.float64


def test_own_state_dicts_load_without_conversion() -> None:
    params = _params()
    ours = AdamW(params)
    _run(ours, params, range(1))
    again = AdamW(_params())
    again.load_state_dict(_roundtrip(ours.state_dict()))
    assert again.last_conversion is not None and not again.last_conversion.converted


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda ps: torch.optim.AdamW(ps, amsgrad=True), "adamw_amsgrad where .* is adamw"),
        (lambda ps: torch.optim.Adam(ps, weight_decay=0.1), "decoupled_weight_decay=False"),
    ],
)
def test_torch_states_it_cannot_continue_are_refused(make: object, words: str) -> None:
    ref_params = _params()
    ref = make(ref_params)  # type: ignore[operator]
    _run(ref, ref_params, range(1))
    ours = AdamW(_params())
    before = {k: v.clone() for k, v in ours.state[ours.param_groups[0]["params"][0]].items()}
    with pytest.raises(ValueError, match=words):
        ours.load_state_dict(ref.state_dict())
    after = ours.state[ours.param_groups[0]["params"][0]]
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_state_is_made_at_the_first_step_and_never_for_frozen_parameters() -> None:
    trainable = torch.nn.Parameter(torch.randn(64, 64).to(torch.bfloat16))
    frozen = torch.nn.Parameter(torch.randn(256, 64).to(torch.bfloat16), requires_grad=False)
    opt = AdamW([trainable, frozen], master="exact")
    ref = torch.optim.AdamW(
        [torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(4))]
    )
    assert len(opt.state) == len(ref.state) == 0
    trainable.grad = torch.ones_like(trainable)
    opt.step()
    assert list(opt.state) == [trainable]
    assert opt.state_dict()["state"].keys() == {0}
    masters = opt.master_weights()  # a never-stepped parameter: its value, upcast
    assert torch.equal(masters[1], frozen.detach().float())


def test_torch_maximize_and_adam_without_decay_are_taken_as_torch_has_them() -> None:
    """Found by review: a torch AdamW dict with maximize=True, and torch Adam with
    weight_decay=0 (which is AdamW), were refused."""
    for make in (
        lambda ps: torch.optim.AdamW(ps, maximize=True),
        lambda ps: torch.optim.Adam(ps, weight_decay=0.0),
    ):
        ref_params = _params()
        ref = make(ref_params)
        _run(ref, ref_params, range(2))
        ours = AdamW(_params())
        ours.load_state_dict(ref.state_dict())
        assert ours.param_groups[0]["maximize"] == ref.param_groups[0]["maximize"]


@pytest.mark.parametrize(
    ("damage", "words"),
    [
        (lambda sd: sd["param_groups"][0].pop("params"), "must be a mapping with a 'params'"),
        (lambda sd: sd["param_groups"].__setitem__(0, None), "must be a mapping"),
        (lambda sd: sd["state"][0].__setitem__("step", torch.tensor(1e30)), "2\\*\\*53"),
        (
            lambda sd: sd["state"][0].__setitem__(
                "exp_avg", torch.empty(sd["state"][0]["exp_avg"].shape, device="meta")
            ),
            "meta tensor",
        ),
    ],
)
def test_malformed_state_dicts_raise_value_error_and_change_nothing(
    damage: object, words: str
) -> None:
    params = _params()
    ours = AdamW(params)
    _run(ours, params, range(1))
    sd = copy.deepcopy(ours.state_dict())  # torch's state_dict shares the live state dicts
    before = {k: v.clone() for k, v in ours.state[params[0]].items()}
    damage(sd)  # type: ignore[operator]
    with pytest.raises(ValueError, match=words):
        ours.load_state_dict(sd)
    assert all(torch.equal(before[k], ours.state[params[0]][k]) for k in before)


def test_other_torch_optimizers_and_mistyped_flags_are_refused() -> None:
    """Found by the second review: RAdam's state (AdamW's keys) loaded as AdamW, and a
    saved maximize='no' turned into gradient ascent."""
    ref_params = _params()
    radam = torch.optim.RAdam(ref_params)
    _run(radam, ref_params, range(1))
    ours = AdamW(_params())
    with pytest.raises(ValueError, match=r"not a torch\.optim\.AdamW"):
        ours.load_state_dict(radam.state_dict())
    params = _params()
    own = AdamW(params)
    _run(own, params, range(1))
    for key, value in (("maximize", "no"), ("fused", "x")):
        sd = copy.deepcopy(own.state_dict())
        sd["param_groups"][0][key] = value
        with pytest.raises(ValueError, match=f"saved {key}="):
            own.load_state_dict(sd)


def test_after_a_resume_a_second_write_or_a_prune_resets_the_masters() -> None:
    """Found by the second review: after load_state_dict every later write kept the old
    remainders (fill_(0.5) gave 0.50014...), and pruned masters were denormals, not 0."""
    params = _params(dtype=torch.bfloat16)
    opt = AdamW(params, master="exact")
    _run(opt, params, range(2))
    saved = copy.deepcopy(opt.state_dict())
    weights = [p.detach().clone() for p in params]
    fresh = _params(1, dtype=torch.bfloat16)
    again = AdamW(fresh, master="exact")
    again.load_state_dict(saved)
    with torch.no_grad():
        for p, w in zip(fresh, weights, strict=True):
            p.copy_(w)  # the resume's checkpoint: masters kept bitwise
        fresh[0].mul_((torch.arange(fresh[0].numel()) % 2).view(fresh[0].shape).bfloat16())
        fresh[1].fill_(0.5)
    masters = again.master_weights()
    assert torch.equal(masters[0], fresh[0].detach().float())  # two writes: reset, zeros 0
    assert torch.equal(masters[1], torch.full_like(masters[1], 0.5))


# -- every torch counterpart: Adam (L2 and decoupled, AMSGrad) and SGD ------------------

#: (name, mixprec optimizer, torch optimizer) with the same options.
COUNTERPARTS = [
    (
        "adam-l2",
        lambda ps: Adam(ps, lr=1e-2, weight_decay=0.1),
        lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1),
    ),
    (
        "adam-decoupled",
        lambda ps: Adam(ps, lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True),
        lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True),
    ),
    (
        "adam-amsgrad",
        lambda ps: Adam(ps, lr=1e-2, weight_decay=0.1, amsgrad=True),
        lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1, amsgrad=True),
    ),
    (
        "adamw-amsgrad",
        lambda ps: AdamW(ps, lr=1e-2, amsgrad=True),
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, amsgrad=True),
    ),
    ("sgd", lambda ps: SGD(ps, lr=1e-2), lambda ps: torch.optim.SGD(ps, lr=1e-2)),
    (
        "sgd-momentum",
        lambda ps: SGD(ps, lr=1e-2, momentum=0.9, dampening=0.1, weight_decay=0.1),
        lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, dampening=0.1, weight_decay=0.1),
    ),
    (
        "sgd-nesterov",
        lambda ps: SGD(ps, lr=1e-2, momentum=0.9, nesterov=True),
        lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True),
    ),
]


def _close(ours: list[torch.nn.Parameter], theirs: list[torch.nn.Parameter]) -> None:
    for p, q in zip(ours, theirs, strict=True):
        torch.testing.assert_close(p, q, atol=TOLERANCE, rtol=TOLERANCE)


@pytest.mark.parametrize(
    ("name", "make", "make_torch"), COUNTERPARTS, ids=lambda c: c if isinstance(c, str) else ""
)
def test_a_torch_run_continues_here_and_ours_continues_in_torch(
    name: str, make: object, make_torch: object
) -> None:
    # torch -> mixprec
    ref_params, our_params = _params(), _params()
    ref = make_torch(ref_params)  # type: ignore[operator]
    _run(ref, ref_params, range(3))
    for p, q in zip(our_params, ref_params, strict=True):
        p.data.copy_(q.data)
    ours = make(our_params)  # type: ignore[operator]
    ours.load_state_dict(_roundtrip(ref.state_dict()))
    conversion = ours.last_conversion
    sources = {"adam-l2": "Adam", "adam-amsgrad": "Adam", "adam-decoupled": "AdamW"}
    expected = sources.get(name, "SGD" if name.startswith("sgd") else "AdamW")
    assert conversion is not None and conversion.source == f"torch.optim.{expected}"
    if name.startswith("sgd"):  # torch keeps no step: a buffer means the next is not the first
        steps = {float(s["step"]) for s in ours.state.values()}
        assert steps == ({1.0} if name != "sgd" else set())
    _run(ref, ref_params, range(3, 6))
    _run(ours, our_params, range(3, 6))
    _close(our_params, ref_params)
    # mixprec -> torch
    exported = _roundtrip(ours.torch_state_dict())
    back_params = [torch.nn.Parameter(p.detach().clone()) for p in our_params]
    back = make_torch(back_params)  # type: ignore[operator]
    back.load_state_dict(exported)
    assert exported["param_groups"][0].keys() == ref.state_dict()["param_groups"][0].keys()
    for pid, torch_state in ref.state_dict()["state"].items():
        assert exported["state"][pid].keys() == torch_state.keys()
    assert exported["state"].keys() == ref.state_dict()["state"].keys()
    _run(back, back_params, range(6, 9))
    _run(ref, ref_params, range(6, 9))
    _close(back_params, ref_params)


def test_a_torch_sgd_parameter_without_a_buffer_has_no_state_here() -> None:
    """torch's SGD keeps ``momentum_buffer: None`` (or nothing) for a parameter it has
    made no buffer for: no state here either, so its next step is its first."""
    ref_params, our_params = _params(), _params()
    ref = torch.optim.SGD(ref_params, lr=1e-2, momentum=0.9)
    _run(ref, ref_params, range(2))
    saved = copy.deepcopy(ref.state_dict())
    saved["state"][1] = {"momentum_buffer": None}
    ours = SGD(our_params, lr=1e-2, momentum=0.9)
    ours.load_state_dict(saved)
    assert set(ours.state) == {our_params[0]} and float(ours.state[our_params[0]]["step"]) == 1
    del saved["state"][1]
    ours.load_state_dict(saved)
    assert set(ours.state) == {our_params[0]}
    assert ours.last_conversion is not None and ours.last_conversion.params == 1


@pytest.mark.parametrize(
    ("make_torch", "make", "words"),
    [
        (
            lambda ps: torch.optim.SGD(ps, momentum=0.9),
            lambda ps: Adam(ps),
            r"not a torch\.optim\.Adam state dict \(its groups have no 'amsgrad', 'betas', 'eps'\)",
        ),
        (
            lambda ps: torch.optim.Adam(ps),
            lambda ps: SGD(ps, momentum=0.9),
            r"not a torch\.optim\.SGD state dict .*'momentum'",
        ),
        (lambda ps: torch.optim.RAdam(ps), lambda ps: Adam(ps), r"not a torch\.optim\.Adam"),
        (lambda ps: torch.optim.Adam(ps), lambda ps: Lion(ps), "Lion has no torch counterpart"),
        (
            lambda ps: torch.optim.AdamW(ps, weight_decay=0.1),
            lambda ps: Adam(ps, weight_decay=0.1),
            "group is adamw where this optimizer's is adam",
        ),
        (
            lambda ps: torch.optim.SGD(ps, momentum=0.9),
            lambda ps: SGD(ps),
            "group is sgd_momentum where this optimizer's is sgd",
        ),
    ],
)
def test_another_optimizers_torch_state_is_refused_in_one_line(
    make_torch: object, make: object, words: str
) -> None:
    ref_params = _params()
    ref = make_torch(ref_params)  # type: ignore[operator]
    _run(ref, ref_params, range(1))
    params = _params()
    ours = make(params)  # type: ignore[operator]
    _run(ours, params, range(1))
    before = {k: v.clone() for k, v in ours.state[params[0]].items()}
    with pytest.raises(ValueError, match=words) as info:
        ours.load_state_dict(ref.state_dict())
    assert "\n" not in str(info.value)
    assert all(torch.equal(before[k], ours.state[params[0]][k]) for k in before)


def test_lion_round_trips_its_own_state_and_has_no_torch_form() -> None:
    params = _params(dtype=torch.bfloat16)
    opt = Lion(params, lr=1e-3, weight_decay=0.1, master="exact", moments="int8")
    _run(opt, params, range(2))
    saved = _roundtrip(opt.state_dict())
    again_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    again = Lion(again_params, lr=1e-3, weight_decay=0.1, master="exact", moments="int8")
    again.load_state_dict(saved)
    assert again.last_conversion is not None
    assert again.last_conversion.source == "mixprec.optim.Lion"
    _run(opt, params, range(2, 4))
    _run(again, again_params, range(2, 4))
    for a, b in zip(opt.master_weights(), again.master_weights(), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="Lion has no torch counterpart") as info:
        opt.torch_state_dict()
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("make", "key"),
    [
        (lambda ps: AdamW(ps, amsgrad=True), "max_exp_avg_sq"),
        (lambda ps: AdamW(ps, amsgrad=True, moments="int8"), "max_exp_avg_sq_absmax"),
        (lambda ps: SGD(ps, momentum=0.9, moments="int8"), "momentum_buffer_absmax"),
        (lambda ps: Lion(ps, moments="int8"), "exp_avg_absmax"),
    ],
)
def test_a_negative_square_moment_or_scale_of_any_rule_is_refused(make: object, key: str) -> None:
    """Found while adding the rules: only AdamW's keys were checked, so a negative
    ``max_exp_avg_sq`` (its square root: NaN in the next step) loaded."""
    params = _params()
    opt = make(params)  # type: ignore[operator]
    _run(opt, params, range(1))
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][0][key] = -sd["state"][0][key].abs() - 1
    with pytest.raises(ValueError, match=f"state '{key}' holds negative values"):
        opt.load_state_dict(sd)


def test_a_torch_state_dict_with_parameter_names_keeps_them_as_torch_does() -> None:
    """torch's load takes ``param_names`` from the saved groups (named parameters)."""
    ref_params = _params()
    ref = torch.optim.SGD([("w", ref_params[0]), ("b", ref_params[1])], lr=0.1, momentum=0.9)
    _run(ref, ref_params, range(1))
    ours = SGD(_params(), lr=0.1, momentum=0.9)
    twin = torch.optim.SGD(_params(), lr=0.1, momentum=0.9)
    ours.load_state_dict(ref.state_dict())
    twin.load_state_dict(ref.state_dict())
    assert ours.param_groups[0]["param_names"] == twin.param_groups[0]["param_names"] == ["w", "b"]


@pytest.mark.parametrize(
    ("cls", "torch_cls"),
    [(Adam, torch.optim.Adam), (AdamW, torch.optim.AdamW), (SGD, torch.optim.SGD)],
    ids=lambda c: c.__name__,
)
def test_each_class_converts_with_the_torch_optimizer_it_replaces(
    cls: type, torch_cls: type
) -> None:
    """The form a class's default rule converts with names the torch class it replaces."""
    opt = cls([torch.nn.Parameter(torch.zeros(3))])
    rule = opt.rule_of(opt.param_groups[0])
    assert TORCH_FORMS[rule.name].torch_name == f"torch.optim.{torch_cls.__name__}"


def test_a_state_dict_of_other_formats_is_refused_with_the_way_to_convert_it() -> None:
    """Loading int4 moments into an int8 optimizer said only that they differ; the one
    line now names the conversion, which this test follows."""
    params = _params(dtype=torch.bfloat16)
    saved_opt = AdamW(params, master="remainder8", moments="int4", min_int8_numel=256)
    _run(saved_opt, params, range(2))
    saved = _roundtrip(saved_opt.state_dict())
    target = AdamW(params, master="exact", moments="int8", min_int8_numel=256)
    with pytest.raises(ValueError, match="master='remainder8' differs") as refused:
        target.load_state_dict(saved)
    assert "torch_state_dict()" in str(refused.value) and "\n" not in str(refused.value)
    # the way it names: an optimizer of the saved formats, then torch's form and masters
    reader = AdamW(params, master="remainder8", moments="int4", min_int8_numel=256)
    reader.load_state_dict(saved)
    target.load_state_dict(reader.torch_state_dict())
    target.load_master_weights(reader.master_weights())
    assert target.last_conversion is not None and target.last_conversion.converted
    assert target.formats() == [("exact", "int8"), ("exact", "fp32")]
