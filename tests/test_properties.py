"""Property-based tests: any file or command line ends in 0, 1 or 2 without a traceback;
any non-finite gradient, anywhere, at any step, under any policy, is never applied."""

from __future__ import annotations

import copy
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import mixprec
from mixprec.cli import main

pytestmark = [
    pytest.mark.slow,
    pytest.mark.usefixtures("stand_in_plots"),  # no property here is about a plot's pixels
    pytest.mark.filterwarnings("ignore::mixprec.errors.PerformanceWarning"),
    pytest.mark.filterwarnings("ignore::mixprec.errors.PrecisionWarning"),
]

#: Wall time one command may take in these properties (they run tiny workloads).
TIME_BOUND_S = 30.0

_KEYS = [
    "workload",
    "size",
    "baseline",
    "candidates",
    "seeds",
    "max_seeds",
    "allow",
    "steps",
    "lr",
    "min_lr",
    "gates",
    "max_rel_loss_gap",
    "confidence",
    "precision",
    "preset",
    "compute_dtype",
    "param_dtype",
    "master",
    "moments",
    "loss_scaling",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
    "max_position_embeddings",
    "optimizer",
    "_target_",
]
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["fp32", "bf16", "bf16_master", "amp_fp16", "digits", "tiny", "1e-3", "${x}"]),
)
_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.sampled_from(_KEYS), inner, max_size=5),
    ),
    max_leaves=20,
)
_documents = st.one_of(
    st.dictionaries(st.sampled_from(_KEYS) | st.text(max_size=8), _values, max_size=8),
    _values,
)


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    started = time.perf_counter()
    code = main(argv)
    elapsed = time.perf_counter() - started
    err = capsys.readouterr().err
    assert code in (0, 1, 2), (argv, code, err)
    assert "Traceback" not in err, (argv, err)
    assert elapsed < TIME_BOUND_S, (argv, elapsed)
    return code, err


_TINY_COMPARE = [
    "--workload",
    "digits",
    "--size",
    "tiny",
    "--steps",
    "1",
    "--seeds",
    "1",
    "--max-seeds",
    "1",
    "--policies",
    "amp_bf16",
    "--quiet",
]


#: Command-line properties: no per-example deadline (the time bound is asserted), and
#: pytest's tmp_path/capsys are shared by the examples of one test on purpose.
CLI_SETTINGS = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@settings(CLI_SETTINGS, max_examples=40)
@given(document=_documents, raw=st.booleans())
def test_any_yaml_document_ends_in_an_exit_code(
    document: Any, raw: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "doc.yaml"
    if raw:
        text = str(document)  # often not YAML at all
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            text = yaml.safe_dump(document, allow_unicode=True)
    path.write_text(text, encoding="utf-8")
    _run(["doctor", str(path)], capsys)
    _run(["budget", "--config", str(path), "--policy", "fp32"], capsys)
    _run(["compare", "--config", str(path), "--out", str(tmp_path / "o"), *_TINY_COMPARE], capsys)


_TOKENS = [
    "formats",
    "policies",
    "budget",
    "doctor",
    "report",
    "--json",
    "--params",
    "--policy",
    "--world-size",
    "--sharding",
    "--seq-len",
    "--config",
    "--format",
    "--baseline",
    "--lr",
    "--min-lr",
    "--batch-size",
    "--device",
    "--allow",
    "--traceback",
    "7B",
    "inf",
    "nan",
    "-1",
    "0",
    "1e400",
    "fp32",
    "all",
    "bf16_pure",
    "amp",
    "ddp",
    "fsdp",
    "cuda",
    "",
    "/nonexistent",
    "vanishing-updates",
]


@settings(CLI_SETTINGS, max_examples=120)
@given(tokens=st.lists(st.sampled_from(_TOKENS) | st.text(max_size=6), max_size=7))
def test_any_command_line_ends_in_an_exit_code(
    tokens: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _run(tokens, capsys)
    # compare with the same noise, pinned to a tiny workload (flags given last win).
    _run(["compare", *tokens, "--out", str(tmp_path / "c"), *_TINY_COMPARE], capsys)


_POLICIES = ["fp32", "amp_bf16", "amp_fp16", "bf16_master", "bf16_lean", "bf16_kahan", "bf16_sr"]


def _state(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [
        t.clone()
        for s in opt.state_dict()["state"].values()
        for t in s.values()
        if isinstance(t, torch.Tensor)
    ]


@settings(max_examples=60, deadline=None)
@given(
    policy=st.sampled_from(_POLICIES),
    bad_step=st.integers(min_value=0, max_value=3),
    param_index=st.integers(min_value=0, max_value=5),
    value=st.sampled_from([float("nan"), float("inf"), float("-inf")]),
    clip=st.booleans(),
    second_bad_step=st.one_of(st.none(), st.integers(min_value=0, max_value=3)),
)
def test_a_non_finite_gradient_is_never_applied(
    policy: str,
    bad_step: int,
    param_index: int,
    value: float,
    clip: bool,
    second_bad_step: int | None,
) -> None:
    torch.manual_seed(0)
    prec = mixprec.Precision(policy)
    model = prec.prepare(nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 2)))
    opt = prec.optimizer(model, lr=1e-2, fused=False)
    params = list(model.parameters())
    bad_steps = {bad_step} | ({second_bad_step} if second_bad_step is not None else set())
    for step in range(4):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        with prec.autocast():
            loss = model(x).float().pow(2).mean()
        prec.backward(loss)
        if step in bad_steps:
            grad = params[param_index].grad
            assert grad is not None
            grad.view(-1)[step % grad.numel()] = value
        if clip:
            prec.clip_grad_norm_(params[:2], 1.0)  # a partial clip
        before_params = [p.detach().clone() for p in params]
        before_state = _state(opt)
        report = prec.step(opt)
        opt.zero_grad(set_to_none=True)
        if step in bad_steps:
            assert not report.applied and report.nonfinite_grads >= 1
        if not report.applied:
            assert all(
                torch.equal(p.detach(), b) for p, b in zip(params, before_params, strict=True)
            )
            after_state = _state(opt)
            assert len(after_state) == len(before_state)
            assert all(torch.equal(a, b) for a, b in zip(after_state, before_state, strict=True))
        assert all(torch.isfinite(p).all() for p in params)
    copy.deepcopy(opt)  # state stays copyable after skipped steps
