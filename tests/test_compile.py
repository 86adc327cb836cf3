"""torch.compile of prepared models with fp32 islands: a tiny HF Llama and the built-in
GPT train a few steps of the documented loop and evaluate as in eager, with no graph
break (tolerances: `tests/tolerances.py`)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from tests.hf_models import tiny_llama
from tests.tolerances import COMPILE_ATOL
from torch import nn
from torch._dynamo.utils import counters

import mixprec
from mixprec.policy import DEFAULT_FP32_MODULES, Policy
from mixprec.workloads.gpt import GPT, GPTConfig

pytestmark = [pytest.mark.compile, pytest.mark.slow]

VOCAB = 256
STEPS = 3


def _llama() -> nn.Module:
    return tiny_llama(vocab_size=VOCAB, max_position_embeddings=2048)


def _gpt() -> nn.Module:
    return GPT(GPTConfig(vocab_size=VOCAB, block_size=32, n_layer=2, n_head=4, n_embd=64))


MODELS: dict[str, Callable[[], nn.Module]] = {"llama": _llama, "gpt": _gpt}


def _policy(model: str, name: str) -> Policy:
    pol = mixprec.preset(name)
    if model == "llama" and pol.fp8 is None:
        # an arbitrary named module as well as the norms: the (untied) output head
        return pol.replace(fp32_modules=(*DEFAULT_FP32_MODULES, "lm_head"))
    return pol


def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    out = model(ids)
    logits: torch.Tensor = out.logits if hasattr(out, "logits") else out
    return logits.float()


def _run(
    model_name: str, policy: Policy, how: str | None, backend: str
) -> tuple[list[float], torch.Tensor, torch.Tensor, tuple[str, ...]]:
    """Losses of `STEPS` steps of the README loop, then no_grad logits of the model
    as built and run eagerly (the same weights); compiled `how` (None: eager)."""
    torch.manual_seed(0)
    model = MODELS[model_name]()
    ids = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(2))
    prec = mixprec.Precision(policy)
    if how == "prepare(torch.compile(m))":
        model = prec.prepare(torch.compile(model, backend=backend))
    else:
        model = prec.prepare(model)
        if how == "torch.compile(m)":
            model = torch.compile(model, backend=backend)
        elif how == "m.compile()":
            model.compile(backend=backend)
    opt = prec.optimizer(model, lr=1e-2)
    losses = []
    for _ in range(STEPS):
        with prec.autocast():
            loss = F.cross_entropy(_logits(model, ids).flatten(0, 1), targets.flatten())
        prec.backward(loss)
        prec.clip_grad_norm_(model.parameters(), 1.0)
        assert prec.step(opt).applied
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        logits = _logits(model, ids)
        with torch.compiler.set_stance("force_eager"):
            eager_logits = _logits(model, ids)
    assert prec.fp32_islands is not None
    return losses, logits, eager_logits, prec.fp32_islands


def _check(model_name: str, policy_name: str, how: str, backend: str) -> None:
    if policy_name.startswith("fp8"):
        pytest.importorskip("torchao.float8")
    policy = _policy(model_name, policy_name)
    eager_losses, _, _, islands = _run(model_name, policy, None, backend)
    torch._dynamo.reset()
    counters.clear()
    losses, logits, eager_logits, compiled_islands = _run(model_name, policy, how, backend)
    breaks = dict(counters["graph_break"])
    assert not breaks, breaks
    assert compiled_islands == islands and len(islands) == 2 * 2 + 1 + (
        model_name == "llama" and policy.fp8 is None
    )
    atol = COMPILE_ATOL[backend]
    loss_gap = max(abs(a - b) for a, b in zip(losses, eager_losses, strict=True))
    logits_gap = (logits - eager_logits).abs().max().item()
    assert loss_gap <= atol["loss"], (losses, eager_losses)
    assert logits_gap <= atol["logits"], logits_gap


# The three ways of compiling rotate over the cases; each runs once per model.
AOT_EAGER_CASES = [
    ("llama", "bf16_master", "torch.compile(m)"),
    ("llama", "bf16_lean", "m.compile()"),
    ("llama", "fp8_rowwise", "prepare(torch.compile(m))"),
    ("gpt", "bf16_master", "m.compile()"),
    ("gpt", "bf16_lean", "prepare(torch.compile(m))"),
    ("gpt", "fp8_tensorwise", "torch.compile(m)"),
]


@pytest.mark.parametrize(("model_name", "policy_name", "how"), AOT_EAGER_CASES)
def test_compiled_with_aot_eager_trains_and_evaluates_as_eager(
    model_name: str, policy_name: str, how: str
) -> None:
    _check(model_name, policy_name, how, "aot_eager")


@pytest.mark.parametrize(("model_name", "policy_name"), [("gpt", "bf16_master")])
def test_compiled_with_inductor_trains_and_evaluates_close_to_eager(
    model_name: str, policy_name: str
) -> None:
    _check(model_name, policy_name, "torch.compile(m)", "inductor")


def test_inductor_runs_a_named_linear_island_in_fp32() -> None:
    """Forward and weight gradient of a Linear named in fp32_modules are fp32 results
    under bf16 autocast, compiled by Inductor as in eager."""
    policy = Policy(
        compute_dtype=torch.bfloat16,
        param_dtype=torch.bfloat16,
        master="exact",
        fp32_modules=("head",),
    )
    model = nn.Sequential()
    model.add_module("head", nn.Linear(512, 64))
    prec = mixprec.Precision(policy)
    compiled = torch.compile(prec.prepare(model), fullgraph=True)
    x = torch.randn(16, 512, dtype=torch.bfloat16)
    with prec.autocast():
        out = compiled(x)
    out.float().sum().backward()
    head = model.head
    with torch.no_grad():
        fp32 = nn.functional.linear(x.float(), head.weight, head.bias)
        bf16 = nn.functional.linear(x, head.weight.bfloat16(), head.bias.bfloat16())
    assert not torch.equal(fp32.bfloat16(), bf16)  # the check below can tell them apart
    assert torch.equal(out, fp32.bfloat16())
    # d(sum)/dW: every row is the column sum of x, summed in fp32 (bf16 would round it)
    column_sums = x.float().sum(0).expand_as(head.weight)
    assert head.weight.grad is not None
    torch.testing.assert_close(head.weight.grad, column_sums, rtol=1e-6, atol=1e-5)
    assert not torch.allclose(column_sums.bfloat16().float(), column_sums, rtol=1e-6, atol=1e-5)
