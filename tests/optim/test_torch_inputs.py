"""torch's own test inputs for Adam, AdamW and SGD, run against mixprec's drop-ins.

`common_optimizers` gives the configurations torch tests each optimizer with on CPU
(its ``optim_inputs_func_*`` with the global flags torch adds: ``fused`` and
``differentiable``); each must match torch within `TORCH_PARITY_REL` on fp32
parameters, or be refused with the one line in `REFUSED`. ``optim_error_inputs_func_*``
gives torch's refusals; mixprec refuses the same inputs with the same error type and
message.
"""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch

import tolerances as tol
from mixprec.optim import SGD, Adam, AdamW, Lion
from mixprec.optim.native.binding import NATIVE_RULES
from mixprec.optim.rule_optimizer import RuleOptimizer

common = pytest.importorskip("torch.testing._internal.common_optimizers")

#: Our drop-in -> the torch class it replaces.
DROP_INS: dict[type[RuleOptimizer], type[torch.optim.Optimizer]] = {
    Adam: torch.optim.Adam,
    AdamW: torch.optim.AdamW,
    SGD: torch.optim.SGD,
}
ALL_CLASSES: tuple[type[RuleOptimizer], ...] = (Adam, AdamW, SGD, Lion)

#: torch options mixprec refuses, with the words of its error, and why (docs/optim.md).
REFUSED = {
    # the step count is read on the host: a step cannot be captured in a CUDA graph
    "capturable": "capturable=True is not supported",
    # the fused step writes parameters and state in place, outside autograd
    "differentiable": "differentiable=True is not supported",
}
TOLERANCE = tol.TORCH_PARITY_REL


def _info(cls: type[torch.optim.Optimizer]) -> object:
    return next(info for info in common.optim_db if info.optim_cls is cls)


def _rule_name(ours: type[RuleOptimizer], kwargs: dict[str, object]) -> str:
    kwargs = {k: v for k, v in kwargs.items() if k not in REFUSED}
    opt = ours([torch.nn.Parameter(torch.zeros(1))], **{**kwargs, "fused": False})
    return opt.rule_of(opt.param_groups[0]).name


def _inputs() -> list[object]:
    """(ours, torch's class, config) for every config torch runs on CPU. ``fused=True``
    of a rule the native kernel does not run yet is compiled by torch.compile on CPU
    (seconds per rule): those are marked ``compile`` and ``slow``."""
    out = []
    for ours, theirs in DROP_INS.items():
        for case in common._get_optim_inputs_including_global_cliquey_kwargs(
            "cpu", torch.float32, _info(theirs)
        ):
            rule = _rule_name(ours, case.kwargs)
            compiled = case.kwargs.get("fused") and rule not in NATIVE_RULES
            marks = [pytest.mark.compile, pytest.mark.slow] if compiled else []
            out.append(
                pytest.param(ours, theirs, case, marks=marks, id=f"{ours.__name__}-{case.desc}")
            )
    return out


def _model_params(seed: int) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    torch.manual_seed(seed)
    ours = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(3))]
    return ours, [torch.nn.Parameter(p.detach().clone()) for p in ours]


def _copy_kwargs(kwargs: dict[str, object]) -> dict[str, object]:
    """Tensor hyperparameters cloned: each optimizer gets its own (a scheduler edits them)."""
    return copy.deepcopy(kwargs)


@pytest.mark.parametrize(("ours", "theirs", "case"), _inputs())
def test_torch_inputs_match_torch_or_raise_the_documented_error(
    ours: type[RuleOptimizer], theirs: type[torch.optim.Optimizer], case: object
) -> None:
    kwargs = dict(case.kwargs)  # type: ignore[attr-defined]
    params, ref_params = _model_params(0)
    refused = [k for k in REFUSED if kwargs.get(k)]
    if refused:
        with pytest.raises(ValueError, match=re.escape(REFUSED[refused[0]])) as info:
            ours(params, **kwargs)
        assert "\n" not in str(info.value)
        return
    opt = ours(params, **_copy_kwargs(kwargs))
    ref = theirs(ref_params, **_copy_kwargs(kwargs))
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        for a, b in zip(params, ref_params, strict=True):
            g = torch.randn(a.shape, generator=gen)
            a.grad, b.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    for a, b in zip(params, ref_params, strict=True):
        torch.testing.assert_close(a, b, atol=TOLERANCE, rtol=TOLERANCE)


def _error_inputs() -> list[object]:
    return [
        pytest.param(ours, case, id=f"{ours.__name__}-{case.error_regex[:40]}")
        for ours, theirs in DROP_INS.items()
        for case in _info(theirs).optim_error_inputs_func(device="cpu", dtype=torch.float32)  # type: ignore[attr-defined]
        if case.error_on == common.OptimizerErrorEnum.CONSTRUCTION_ERROR
    ]


@pytest.mark.parametrize(("ours", "case"), _error_inputs())
def test_torch_error_inputs_fail_alike(ours: type[RuleOptimizer], case: object) -> None:
    err = case.optimizer_error_input  # type: ignore[attr-defined]
    params = err.params if err.params is not None else [torch.nn.Parameter(torch.randn(2, 2))]
    params = copy.copy(params)
    kind, regex = case.error_type, case.error_regex  # type: ignore[attr-defined]
    if issubclass(kind, Warning):
        with pytest.warns(kind, match=regex):
            ours(params, **err.kwargs)
        return
    with pytest.raises(kind, match=regex), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        ours(params, **err.kwargs)


def test_every_error_input_torch_has_is_a_construction_error() -> None:
    """The error inputs above are those raised when the optimizer is built; one raised
    at a step would need its own test (none in this torch)."""
    for theirs in DROP_INS.values():
        for case in _info(theirs).optim_error_inputs_func(device="cpu", dtype=torch.float32):  # type: ignore[attr-defined]
            assert case.error_on == common.OptimizerErrorEnum.CONSTRUCTION_ERROR


#: What each class refuses: (kwargs, error type, the words of its one line).
_OPTIONS = [
    ({"capturable": True}, ValueError, "capturable=True is not supported"),
    ({"differentiable": True}, ValueError, "differentiable=True is not supported"),
    ({"foreach": "yes"}, TypeError, "foreach must be True, False or None"),
]


def _accepts(cls: type[RuleOptimizer], key: str) -> bool:
    import inspect

    return key in inspect.signature(cls.__init__).parameters


@pytest.mark.parametrize("cls", ALL_CLASSES, ids=lambda c: c.__name__)
@pytest.mark.parametrize(("kwargs", "kind", "words"), _OPTIONS)
def test_options_that_cannot_be_honoured_raise(
    cls: type[RuleOptimizer], kwargs: dict[str, object], kind: type[Exception], words: str
) -> None:
    """In the constructor where it takes the option (torch's signature), and in a group
    (every class: a group may carry any key)."""
    p, q = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(4))
    if all(_accepts(cls, k) for k in kwargs):
        with pytest.raises(kind, match=re.escape(words)) as info:
            cls([p], **kwargs)  # type: ignore[arg-type]
        assert "\n" not in str(info.value)
    with pytest.raises(kind, match=re.escape(words)):
        cls([{"params": [p], **kwargs}])
    opt = cls([p])
    with pytest.raises(kind, match=re.escape(words)):
        opt.add_param_group({"params": [q], **kwargs})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("cls", ALL_CLASSES, ids=lambda c: c.__name__)
@pytest.mark.parametrize(
    ("dtype", "words"),
    [
        (torch.float64, r"float64: mixprec's optimizers compute .* use the torch optimizer"),
        (torch.complex64, r"need floating params, got .*use the torch optimizer for complex"),
    ],
)
def test_float64_and_complex_parameters_are_refused_with_the_alternative(
    cls: type[RuleOptimizer], dtype: torch.dtype, words: str
) -> None:
    p = torch.nn.Parameter(torch.zeros(3, dtype=dtype))
    with pytest.raises(ValueError, match=words) as info:
        cls([p])
    assert "\n" not in str(info.value)


def test_a_group_asking_for_amsgrad_steps_as_torchs_does() -> None:
    ours, theirs = _model_params(0)
    opt = AdamW([{"params": [ours[0]]}, {"params": [ours[1]], "amsgrad": True}], lr=0.1)
    ref = torch.optim.AdamW(
        [{"params": [theirs[0]]}, {"params": [theirs[1]], "amsgrad": True}], lr=0.1
    )
    assert [r.name for r in map(opt.rule_of, opt.param_groups)] == ["adamw", "adamw_amsgrad"]
    gen = torch.Generator().manual_seed(1)
    for scale in (1.0, 0.1, 0.1):  # a shrinking gradient: the maximum holds the denominator up
        for a, b in zip(ours, theirs, strict=True):
            a.grad = torch.randn(a.shape, generator=gen) * scale
            b.grad = a.grad.clone()
        opt.step()
        ref.step()
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, atol=TOLERANCE, rtol=TOLERANCE)


def test_amsgrad_false_positionally_and_every_torch_keyword_are_accepted() -> None:
    p, q = torch.nn.Parameter(torch.randn(8)), torch.nn.Parameter(torch.randn(8))
    q.data.copy_(p.data)
    args = (1e-2, (0.9, 0.99), 1e-8, 0.1, False)
    opt = AdamW([p], *args, maximize=False, foreach=True, capturable=False, differentiable=False)
    ref = torch.optim.AdamW([q], *args, foreach=True)
    for key in ("amsgrad", "foreach", "capturable", "differentiable", "maximize"):
        assert opt.defaults[key] == ref.defaults[key], key
    p.grad = torch.ones(8)
    q.grad = torch.ones(8)
    opt.step()
    ref.step()
    torch.testing.assert_close(p, q, atol=TOLERANCE, rtol=TOLERANCE)


def test_tensor_lr_and_betas_work_as_in_torch() -> None:
    p, q = torch.nn.Parameter(torch.randn(6)), torch.nn.Parameter(torch.randn(6))
    q.data.copy_(p.data)
    lr, betas = torch.tensor(0.01), (torch.tensor(0.8), torch.tensor(0.9))
    opt = AdamW([p], lr=lr, betas=betas)
    ref = torch.optim.AdamW([q], lr=lr.clone(), betas=(betas[0].clone(), betas[1].clone()))
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ref_scheduler = torch.optim.lr_scheduler.StepLR(ref, step_size=1, gamma=0.5)
    for _ in range(3):
        p.grad = torch.full((6,), 0.5)
        q.grad = torch.full((6,), 0.5)
        opt.step()
        ref.step()
        scheduler.step()
        ref_scheduler.step()
    torch.testing.assert_close(p, q, atol=TOLERANCE, rtol=TOLERANCE)


def test_numpy_and_tensor_hyperparameters_are_taken_as_torch_takes_them() -> None:
    np = pytest.importorskip("numpy")
    p = [torch.nn.Parameter(torch.ones(3))]
    for kwargs in (
        {"lr": np.float32(1e-3)},
        {"lr": np.float64(1e-3), "betas": (np.float64(0.9), np.float64(0.99))},
        {"eps": np.float32(1e-6)},
        {"weight_decay": torch.tensor(0.1)},
        {"weight_decay": np.float32(0.1)},
    ):
        ours, ref = AdamW(p, **kwargs), torch.optim.AdamW(p, **kwargs)
        assert ours.param_groups[0]["lr"] == ref.param_groups[0]["lr"]


@pytest.mark.parametrize(
    ("seed", "error"),
    [(1.9, TypeError), ("1", TypeError), (True, TypeError), (-1, ValueError), (2**32, ValueError)],
)
def test_a_seed_that_is_not_a_32_bit_int_is_refused_not_coerced(
    seed: object, error: type[Exception]
) -> None:
    """1.9, "1", True and 2**64 + 1 all gave seed 1's noise."""
    with pytest.raises(error, match="seed"):
        AdamW([torch.nn.Parameter(torch.ones(3).bfloat16())], master="stochastic", seed=seed)  # type: ignore[arg-type]
