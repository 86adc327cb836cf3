"""Measurement on a real step, held against the estimate; optimizer state by category."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from hf_models import tiny_llama
from mixprec import Precision
from mixprec.memory import (
    estimate,
    measure,
    optimizer_state_bytes,
    optimizer_state_nbytes,
    training_state_bytes,
)
from mixprec.optim import AdamW
from mixprec.policy import PRESET_NAMES

from .gpt import gpt_and_batch


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_predicted_equals_measured_on_gpt(name: str) -> None:
    wl, model, x, y = gpt_and_batch()
    prec = Precision(name)
    prec.prepare(model)
    opt = prec.optimizer(model, lr=1e-3)
    predicted = estimate(model, prec.policy, inputs=x, loss_fn=wl.loss, targets=y)  # type: ignore[attr-defined]

    def step() -> None:
        with prec.autocast():
            out = model(x)
        prec.backward(wl.loss(out, y))  # type: ignore[attr-defined]
        prec.step(opt)
        opt.zero_grad(set_to_none=True)

    got = measure(model, opt, step, policy=prec.policy)
    for comp in ("params", "fp32_islands", "grads", "released_grads", "master", "moments"):
        assert getattr(got.bytes, comp) == getattr(predicted.bytes, comp), comp
    assert predicted.bytes.activations == pytest.approx(got.bytes.activations, rel=0.15)
    # Released gradients: none held at the step, the largest one (the tied embedding's)
    # during backward.
    released = prec.policy.release_gradients
    assert (got.bytes.grads == 0) == released
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    assert got.bytes.released_grads == (largest if released else 0)


def test_state_bytes_by_category() -> None:
    n = 1 << 14
    p = torch.zeros(n, dtype=torch.bfloat16, requires_grad=True)
    p.grad = torch.zeros_like(p)
    lean = AdamW([p], master="remainder8", moments="int8", fused=False)
    assert training_state_bytes(lean)["master"] == 0  # as torch: no state before a step
    lean.step()
    got = training_state_bytes(lean)
    assert got["params"] == 2 * n and got["grads"] == 2 * n
    assert got["master"] == n
    assert got["moments"] == 2 * n + 2 * 4 * (n // 256)
    assert got["total"] / n <= 7.1
    q = torch.zeros(n, requires_grad=True)
    ref = torch.optim.AdamW([q])
    q.grad = torch.zeros_like(q)
    ref.step()
    assert optimizer_state_bytes(ref)["moments"] == 8 * n
    w = torch.zeros(n, dtype=torch.bfloat16, requires_grad=True)
    exact = AdamW([w], fused=False)
    w.grad = torch.zeros_like(w)
    exact.step()
    assert optimizer_state_bytes(exact)["master"] == 2 * n
    assert optimizer_state_bytes(exact)["moments"] == 8 * n


def test_state_bytes_count_the_parts_of_wrapper_subclass_states() -> None:
    subclass_8bit = pytest.importorskip("torchao.optim.subclass_8bit")
    n = 4096
    p = torch.zeros(n, requires_grad=True)
    opt = torch.optim.SGD([p])
    zeros = subclass_8bit.OptimState8bit.zeros  # what torchao's AdamW8bit allocates
    opt.state[p] = {"exp_avg": zeros((n,), True, 256), "exp_avg_sq": zeros((n,), False, 256)}
    codes, scales, qmaps = 2 * n, 2 * 4 * (n // 256), 2 * 4 * 256  # uint8, fp32, fp32
    assert optimizer_state_bytes(opt)["moments"] == codes + scales + qmaps


@pytest.mark.parametrize(
    ("make", "moments"),
    [
        (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), 4 * 64),  # momentum_buffer
        (lambda ps: torch.optim.RMSprop(ps, momentum=0.9), 2 * 4 * 64),  # square_avg + momentum
        (lambda ps: torch.optim.Adagrad(ps), 4 * 64),  # sum
    ],
)
def test_torch_optimizer_moments_are_moments(make: object, moments: int) -> None:
    p = torch.zeros(64, requires_grad=True)
    opt = make([p])  # type: ignore[operator]
    p.grad = torch.ones_like(p)
    opt.step()
    got = optimizer_state_bytes(opt)
    assert got["moments"] == moments
    assert got["master"] == 0
    assert got["total"] == got["moments"] + got["other"]


def test_one_optimizer_state_measurement() -> None:
    assert optimizer_state_nbytes is optimizer_state_bytes  # the earlier name, same function
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)).to(torch.bfloat16)
    opt = AdamW(model.parameters(), master="exact", moments="fp32", fused=False)
    x = torch.randn(4, 64, dtype=torch.bfloat16)

    def step() -> None:
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    got = measure(model, opt, step)
    state = optimizer_state_bytes(opt)
    n = sum(p.numel() for p in model.parameters())
    assert got.bytes.master == state["master"] == 2 * n
    assert got.bytes.moments == state["moments"] == 8 * n
    assert f"optimizer other state: {state['other']} bytes" in got.notes[0]
    whole = training_state_bytes(opt)
    assert got.bytes.params == whole["params"] == 2 * n
    assert got.bytes.grads == 2 * n and whole["grads"] == 0  # measured as accumulated


class _LoraLike(nn.Module):
    """A frozen 1024x1024 base and a trainable rank-8 adapter, with a LayerNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(1024, 1024, bias=False).requires_grad_(False)
        self.down = nn.Linear(1024, 8, bias=False)
        self.up = nn.Linear(8, 1024, bias=False)
        self.norm = nn.LayerNorm(1024)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.base(x) + self.up(self.down(x)))


class _TiedFrozen(nn.Module):
    """Tied input/output embeddings and a frozen middle block."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(512, 64)
        self.block = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
        self.block.requires_grad_(False)
        self.head = nn.Linear(64, 512, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.emb(x)))


@pytest.mark.parametrize("name", ["bf16_master", "bf16_lean", "bf16_lean4", "amp_bf16", "fp32"])
@pytest.mark.parametrize("make", [_LoraLike, _TiedFrozen], ids=["lora", "tied"])
def test_frozen_and_tied_parameters_are_predicted_as_measured(name: str, make: type) -> None:
    """Found in review of the drop-in claim: the estimate left frozen parameters out (a
    LoRA-like model held 2.1 MB of parameters against 33 KB predicted)."""
    torch.manual_seed(0)
    model = make()
    prec = Precision(name)
    prec.prepare(model)
    opt = prec.optimizer([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    x = torch.randint(0, 512, (4, 8)) if make is _TiedFrozen else torch.randn(4, 1024)
    predicted = estimate(model, prec.policy)

    def step() -> None:
        with prec.autocast():
            loss = model(x).float().pow(2).mean()
        prec.backward(loss)
        prec.step(opt)
        opt.zero_grad(set_to_none=True)

    got = measure(model, opt, step, policy=prec.policy)
    for comp in ("params", "fp32_islands", "grads", "released_grads", "master", "moments"):
        assert getattr(got.bytes, comp) == getattr(predicted.bytes, comp), comp


class _CachedRotary(nn.Module):
    """A linear scaled by a cached table (a rotary cache, ``persistent=False``), and a
    trainable parameter that the forward never uses."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 32)
        self.register_buffer("cos", torch.randn(16, 32), persistent=False)
        self.spare = nn.Parameter(torch.zeros(64, 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * self.cos  # the product saves the cache for backward


def _tiny_llama() -> tuple[nn.Module, torch.Tensor, Callable[[Any, Any], torch.Tensor]]:
    torch.manual_seed(0)
    model = tiny_llama(vocab_size=128, tie_word_embeddings=False)
    return model, torch.randint(0, 128, (2, 16)), lambda out, _: out.logits.float().pow(2).mean()


def _toy() -> tuple[nn.Module, torch.Tensor, Callable[[Any, Any], torch.Tensor]]:
    torch.manual_seed(0)
    return _CachedRotary(), torch.randn(16, 32), lambda out, _: out.float().pow(2).mean()


@pytest.mark.parametrize("name", ["fp32", "bf16_master", "amp_bf16"])
@pytest.mark.parametrize("make", [_toy, _tiny_llama], ids=["toy", "llama"])
def test_buffers_and_unused_parameters_are_predicted_as_measured(name: str, make: Any) -> None:
    """Reported: a buffer the forward saves (a rotary cache) was an estimated activation
    and no measured component; a trainable parameter that gets no gradient was
    estimated with a gradient, master and moments (none exist after a real step)."""
    model, x, loss_fn = make()
    prec = Precision(name)
    prec.prepare(model)
    opt = prec.optimizer(model, lr=1e-3)
    predicted = estimate(model, prec.policy, inputs=x, loss_fn=loss_fn)

    def step() -> None:
        with prec.autocast():
            out = model(x)
        prec.backward(loss_fn(out, None))
        prec.step(opt)
        opt.zero_grad(set_to_none=True)

    got = measure(model, opt, step, policy=prec.policy)
    buffers = sum(b.untyped_storage().nbytes() for b in model.buffers())
    assert got.bytes.buffers == predicted.bytes.buffers == buffers > 0
    assert got.bytes.to_dict() == predicted.bytes.to_dict()


def test_without_a_forward_every_trainable_parameter_is_assumed_to_get_a_gradient() -> None:
    """Only a forward shows which parameters get no gradient: without inputs the estimate
    counts a gradient for every trainable one and says so; a frozen one never gets one."""
    model, x, loss_fn = _toy()
    model.proj.bias.requires_grad_(False)
    blind = estimate(model, "fp32")
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert blind.bytes.grads == 4 * trainable
    assert any("assumed to get a gradient" in n for n in blind.notes)
    seen = estimate(model, "fp32", inputs=x, loss_fn=loss_fn)
    assert seen.bytes.grads == 4 * model.proj.weight.numel()
    assert any("spare" in n for n in seen.notes)


def test_a_step_that_accumulates_holds_one_micro_batch_of_activations() -> None:
    """Review: measure added up the activations of every micro-batch of a step (228,228,
    453,512 and 820,496 B at 1, 2 and 4), where each backward frees its own: the
    activations are the most held at once, one micro-batch's, as estimate predicts."""
    model, x, loss_fn = _tiny_llama()
    prec = Precision("bf16_master")
    prec.prepare(model)
    opt = prec.optimizer(model, lr=1e-3)

    def steps(micro_batches: int) -> Callable[[], None]:
        def step() -> None:
            for _ in range(micro_batches):
                with prec.autocast():
                    loss = loss_fn(model(x), None)
                prec.backward(loss / micro_batches)
            prec.step(opt)
            opt.zero_grad(set_to_none=True)

        return step

    one, *more = (measure(model, opt, steps(n), policy=prec.policy) for n in (1, 2, 4))
    assert one.bytes.activations > 0
    for m in more:
        assert m.bytes.activations == one.bytes.activations
