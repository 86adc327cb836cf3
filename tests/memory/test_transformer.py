"""TransformerShape: parameter counts and the activation formula against the built-in GPT."""

from __future__ import annotations

import pytest

from mixprec import Precision
from mixprec.memory import TransformerShape, estimate, measure

from .gpt import gpt_and_batch, shape_of


def test_transformer_shape_counts_the_workload_gpt() -> None:
    _wl, model, x, _ = gpt_and_batch("default")
    shape = shape_of(model, x)
    matrices, norms = shape.param_counts()
    assert matrices + norms == sum(p.numel() for p in model.parameters())


def test_transformer_activation_formula_against_measurement() -> None:
    wl, model, x, y = gpt_and_batch("default")
    shape = shape_of(model, x)
    prec = Precision("bf16_master")
    prec.prepare(model)
    opt = prec.optimizer(model, lr=1e-3)

    def step() -> None:
        with prec.autocast():
            out = model(x)
        prec.backward(wl.loss(out, y))  # type: ignore[attr-defined]
        prec.step(opt)

    got = measure(model, opt, step, policy=prec.policy).bytes.activations
    formula = estimate(shape, "bf16_master").bytes.activations
    assert formula == pytest.approx(got, rel=0.15)


def test_transformer_from_hf_config() -> None:
    llama = {
        "model_type": "llama",
        "num_hidden_layers": 32,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "vocab_size": 32000,
        "intermediate_size": 11008,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    }
    shape = TransformerShape.from_config(llama)
    matrices, norms = shape.param_counts()
    assert 6.7e9 < matrices + norms < 6.8e9  # LLaMA-2 7B: 6.74e9
    with pytest.raises(ValueError, match="config has none of"):
        TransformerShape.from_config({"hidden_size": 8})
