"""The shakespeare workload: determinism, batches, training, evaluation."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import pytest
import torch
from torch import nn

from mixprec.workloads import GPT, SHAKESPEARE_SIZES, Workload, load_workload
from mixprec.workloads.plays import load_play_split

TrainFn = Callable[..., nn.Module]


@pytest.fixture(scope="module")
def tiny() -> Workload:
    return load_workload("shakespeare", size="tiny")


def _bf16() -> contextlib.AbstractContextManager[object]:
    return torch.autocast("cpu", dtype=torch.bfloat16)


def test_same_seed_gives_bitwise_same_weights(tiny: Workload) -> None:
    a = tiny.make_model(3).state_dict()
    b = tiny.make_model(3).state_dict()
    c = tiny.make_model(4).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert all(t.dtype == torch.float32 for t in a.values())
    assert not torch.equal(a["wte.weight"], c["wte.weight"])


def test_batches_depend_on_seed_and_step_only(tiny: Workload) -> None:
    def batch(step: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        return tiny.train_batch(step=step, seed=seed, batch_size=8, device="cpu")

    torch.manual_seed(0)
    x, y = batch(5, 1)
    torch.manual_seed(1)
    x2, y2 = batch(5, 1)
    assert torch.equal(x, x2)
    assert torch.equal(y, y2)
    assert not torch.equal(batch(6, 1)[0], x)
    assert not torch.equal(batch(5, 2)[0], x)
    block = tiny.config["block_size"]
    assert x.shape == y.shape == (8, block)
    assert x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are inputs shifted by one


def test_batches_are_training_text(tiny: Workload) -> None:
    split = load_play_split()
    vocab = split.vocab
    train_text = vocab.decode(split.train_ids)
    held_text = vocab.decode(split.held_out_ids)
    x, y = tiny.train_batch(step=0, seed=0, batch_size=4, device="cpu")
    for row_x, row_y in zip(x, y, strict=True):
        window = vocab.decode(row_x) + vocab.decode(row_y[-1:])
        assert window in train_text
        assert window not in held_text


def test_train_batch_rejects_bad_arguments(tiny: Workload) -> None:
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        tiny.train_batch(step=0, seed=0, batch_size=0, device="cpu")
    with pytest.raises(ValueError, match="step must be a non-negative int"):
        tiny.train_batch(step=-1, seed=0, batch_size=2, device="cpu")


def test_default_size_is_about_0_8m_params() -> None:
    default = SHAKESPEARE_SIZES["default"]
    vocab_size = load_play_split(default.held_out_plays).vocab.size
    model = GPT(default.gpt_config(vocab_size=vocab_size))
    num_params = sum(p.numel() for p in model.parameters())
    assert 700_000 < num_params < 900_000
    assert load_workload("shakespeare").config["num_params"] == num_params


def test_training_lowers_held_out_loss(tiny: Workload, train: TrainFn) -> None:
    before = tiny.evaluate(tiny.make_model(0), autocast=contextlib.nullcontext)
    model = train(tiny, steps=30)
    after = tiny.evaluate(model, autocast=contextlib.nullcontext)
    assert after.loss < before.loss - 0.5
    assert after.metric_name == "bits_per_char"
    assert after.metric == pytest.approx(after.loss / math.log(2.0))
    assert 0.0 < after.metric < math.log2(load_play_split().vocab.size) + 1.0
    assert 0.0 <= after.extras["accuracy"] <= 1.0
    config = SHAKESPEARE_SIZES["tiny"]
    assert after.num_targets == config.eval_windows * config.block_size


def test_evaluate_is_deterministic_and_restores_mode(tiny: Workload) -> None:
    model = tiny.make_model(0)
    model.train()
    first = tiny.evaluate(model, autocast=contextlib.nullcontext)
    assert model.training
    assert first == tiny.evaluate(model, autocast=contextlib.nullcontext)
    model.eval()
    tiny.evaluate(model, autocast=contextlib.nullcontext)
    assert not model.training


def test_evaluate_under_bf16_autocast(tiny: Workload, train: TrainFn) -> None:
    model = train(tiny, steps=10)
    model.train()
    fp32 = tiny.evaluate(model, autocast=contextlib.nullcontext)
    seen: list[torch.dtype] = []
    handle = model.register_forward_hook(lambda m, args, out: seen.append(out.dtype))
    bf16 = tiny.evaluate(model, autocast=_bf16)
    handle.remove()
    assert model.training
    assert all(m.training for m in model.modules())
    assert math.isfinite(bf16.loss)
    # Autocast really ran: the logits came out in bf16. (The mean loss itself can
    # coincide with fp32's to the last bit on a small model.)
    assert seen and set(seen) == {torch.bfloat16}
    assert bf16.loss == pytest.approx(fp32.loss, abs=0.05)


def test_loss_is_fp32_for_bf16_logits(tiny: Workload) -> None:
    logits = torch.randn(2, 3, 5).to(torch.bfloat16)
    targets = torch.randint(0, 5, (2, 3))
    loss = tiny.loss(logits, targets)
    assert loss.dtype == torch.float32
    assert loss.shape == ()


def test_overrides_and_bad_values() -> None:
    workload = load_workload(
        "shakespeare", size="tiny", n_layer=2, eval_windows=8, held_out_plays=("hamlet",)
    )
    assert workload.config["n_layer"] == 2
    assert workload.config["held_out_plays"] == ("hamlet",)
    assert "hamlet" in workload.description
    model = workload.make_model(0)
    assert isinstance(model, GPT)
    assert len(model.blocks) == 2
    with pytest.raises(ValueError, match=r"unknown shakespeare option\(s\) 'layers'; valid: "):
        load_workload("shakespeare", layers=2)
    with pytest.raises(ValueError, match="n_embd=32 must be divisible by n_head=3"):
        load_workload("shakespeare", size="tiny", n_head=3)
    with pytest.raises(ValueError, match="unknown shakespeare size 'huge'; valid: tiny, small"):
        load_workload("shakespeare", size="huge")
    with pytest.raises(ValueError, match="held_out_plays must be a sequence of play names"):
        load_workload("shakespeare", size="tiny", held_out_plays="macbeth")
