"""torch's own AdamW test inputs, run against `mixprec.optim.AdamW` (the drop-in claim).

`optim_inputs_func_adamw` gives the configurations torch tests AdamW with; each
must either match torch within 1e-6 on fp32 parameters or raise the documented
`ValueError` (amsgrad). `optim_error_inputs_func_adamw` gives torch's refusals;
mixprec refuses the same inputs with the same error type and message.
"""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch

from mixprec.optim import AdamW

common = pytest.importorskip("torch.testing._internal.common_optimizers")

#: torch options mixprec refuses, with the words of its error (docs/optim.md).
REFUSED = {"capturable": "capturable=True"}
TOLERANCE = 1e-6


def _inputs() -> list[object]:
    return list(common.optim_inputs_func_adamw(device="cpu", dtype=torch.float32))


def _model_params(seed: int) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    torch.manual_seed(seed)
    ours = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(3))]
    return ours, [torch.nn.Parameter(p.detach().clone()) for p in ours]


@pytest.mark.parametrize("case", _inputs(), ids=lambda c: c.desc)
def test_torch_adamw_inputs_match_torch_or_raise_the_documented_error(case: object) -> None:
    kwargs = dict(case.kwargs)  # type: ignore[attr-defined]
    ours, theirs = _model_params(0)
    refused = [k for k in REFUSED if kwargs.get(k)]
    if refused:
        with pytest.raises(ValueError, match=REFUSED[refused[0]]):
            AdamW(ours, **kwargs)
        return
    opt = AdamW(ours, **kwargs)
    ref = torch.optim.AdamW(theirs, **kwargs)
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        for a, b in zip(ours, theirs, strict=True):
            g = torch.randn(a.shape, generator=gen)
            a.grad, b.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, atol=TOLERANCE, rtol=TOLERANCE)


def _error_inputs() -> list[object]:
    return list(common.optim_error_inputs_func_adamw(device="cpu", dtype=torch.float32))


@pytest.mark.parametrize("case", _error_inputs(), ids=lambda c: c.error_regex[:40])
def test_torch_adamw_error_inputs_fail_alike(case: object) -> None:
    err = case.optimizer_error_input  # type: ignore[attr-defined]
    params = err.params if err.params is not None else [torch.nn.Parameter(torch.randn(2, 2))]
    params = copy.copy(params)
    kind, regex = case.error_type, case.error_regex  # type: ignore[attr-defined]
    if issubclass(kind, Warning):
        with pytest.warns(kind, match=regex):
            AdamW(params, **err.kwargs)
        return
    with pytest.raises(kind, match=regex), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        AdamW(params, **err.kwargs)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"capturable": True}, "capturable=True is not supported"),
        ({"differentiable": True}, "differentiable=True is not supported"),
        ({"foreach": "yes"}, "foreach must be True, False or None"),
    ],
)
def test_options_that_cannot_be_honoured_raise(kwargs: dict[str, object], words: str) -> None:
    p = torch.nn.Parameter(torch.zeros(4))
    kind = TypeError if "foreach" in kwargs else ValueError
    with pytest.raises(kind, match=re.escape(words)):
        AdamW([p], **kwargs)  # type: ignore[arg-type]


def test_a_group_asking_for_amsgrad_steps_as_torchs_does() -> None:
    ours, theirs = _model_params(0)
    opt = AdamW([{"params": [ours[0]]}, {"params": [ours[1]], "amsgrad": True}], lr=0.1)
    ref = torch.optim.AdamW(
        [{"params": [theirs[0]]}, {"params": [theirs[1]], "amsgrad": True}], lr=0.1
    )
    assert [r.name for r in map(opt._rule_of, opt.param_groups)] == ["adamw", "adamw_amsgrad"]
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


def test_float64_parameters_are_refused_not_computed_in_fp32() -> None:
    with pytest.raises(ValueError, match=r"float64: mixprec's optimizers compute .* in fp32"):
        AdamW([torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))])


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
