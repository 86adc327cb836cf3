from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
from torch import nn

from mixprec import Precision
from mixprec.cli import main
from mixprec.errors import PerformanceWarning, PrecisionWarning
from mixprec.memory import TransformerShape, estimate, measure
from mixprec.policy import PRESET_NAMES
from mixprec.workloads import load_workload

GiB = 2**30


@pytest.fixture(autouse=True)
def _quiet() -> object:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PrecisionWarning)
        warnings.simplefilter("ignore", PerformanceWarning)
        yield


def test_7b_fp32_adamw_is_112_gb_of_state() -> None:
    b = estimate(7_000_000_000, "fp32")
    assert b.bytes.params + b.bytes.grads + b.bytes.moments == 112_000_000_000
    assert b.bytes.master == 0 and b.state_bytes_per_param == 16


def test_textbook_example() -> None:
    # 1e8 parameters, 8e8 stored activation values, Adam.
    fp32 = estimate(100_000_000, "fp32", activation_values=8e8)
    half = estimate(100_000_000, "amp_bf16", activation_values=8e8)
    assert round(fp32.bytes.total / GiB, 2) == 4.47
    assert round(half.bytes.total / GiB, 2) == 2.98


@pytest.mark.parametrize(
    ("name", "per_param"), [("fp32", 16), ("amp_bf16", 16), ("bf16_master", 14), ("bf16_pure", 8)]
)
def test_state_bytes_per_param(name: str, per_param: float) -> None:
    assert estimate(10_000_000, name).state_bytes_per_param == per_param


def test_bf16_lean_is_about_7_bytes_per_param() -> None:
    assert estimate(10_000_000, "bf16_lean").state_bytes_per_param <= 7.1


def test_fsdp_divides_sharded_components_and_counts_communication() -> None:
    n = 8_000_000
    one = estimate(n, "bf16_master")
    eight = estimate(n, "bf16_master", world_size=8, sharding="fsdp")
    for comp in ("params", "grads", "master", "moments"):
        assert getattr(eight.per_rank, comp) * 8 == getattr(one.bytes, comp), comp
    assert eight.comm_bytes_per_step["all_gather"] == 2 * n * 2  # bf16, forward + backward
    assert eight.comm_bytes_per_step["reduce_scatter"] == n * 4  # fp32 reduce
    ddp = estimate(n, "bf16_master", world_size=8, sharding="ddp")
    assert ddp.per_rank.params == one.bytes.params
    assert ddp.comm_bytes_per_step["all_reduce"] == n * 4
    assert ddp.bytes.total == 8 * ddp.per_rank.total


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        estimate(10, "fp32", world_size=0)
    with pytest.raises(ValueError, match="sharding must be one of"):
        estimate(10, "fp32", world_size=2, sharding="zero3")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown precision policy"):
        estimate(10, "fp17")


def _gpt_and_batch(size: str = "tiny") -> tuple[object, nn.Module, torch.Tensor, torch.Tensor]:
    wl = load_workload("shakespeare", size=size)
    model = wl.make_model(0)
    x, y = wl.train_batch(step=0, seed=0, batch_size=wl.defaults.batch_size, device="cpu")
    return wl, model, x, y


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_predicted_equals_measured_on_gpt(name: str) -> None:
    wl, model, x, y = _gpt_and_batch()
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
    for comp in ("params", "fp32_islands", "grads", "master", "moments"):
        assert getattr(got.bytes, comp) == getattr(predicted.bytes, comp), comp
    assert predicted.bytes.activations == pytest.approx(got.bytes.activations, rel=0.15)


def _shape_of(model: nn.Module, x: torch.Tensor) -> TransformerShape:
    """The workload GPT described as a config (what `mixprec budget --config` reads)."""
    cfg = model.config  # type: ignore[attr-defined]
    return TransformerShape(
        n_layer=cfg.n_layer,
        hidden=cfg.n_embd,
        n_head=cfg.n_head,
        vocab=cfg.vocab_size,
        seq_len=cfg.block_size,
        micro_batch=x.shape[0],
        tied_embeddings=cfg.tie_weights,
        learned_positions=True,
    )


def test_transformer_shape_counts_the_workload_gpt() -> None:
    _wl, model, x, _ = _gpt_and_batch("default")
    shape = _shape_of(model, x)
    matrices, norms = shape.param_counts()
    assert matrices + norms == sum(p.numel() for p in model.parameters())


def test_transformer_activation_formula_against_measurement() -> None:
    wl, model, x, y = _gpt_and_batch("default")
    shape = _shape_of(model, x)
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


def test_budget_cli_side_by_side(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["budget", "--params", "7e9", "--policy", "all"]) == 0
    out = capsys.readouterr().out
    for name in PRESET_NAMES:
        assert name in out
    assert main(["budget", "--params", "7e9", "--policy", "all", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [d["policy"] for d in data] == list(PRESET_NAMES)
    fp32 = data[0]
    assert (
        fp32["bytes"]["params"] + fp32["bytes"]["grads"] + fp32["bytes"]["moments"]
        == 112_000_000_000
    )
    assert set(fp32) >= {
        "policy",
        "params",
        "world_size",
        "bytes",
        "per_rank",
        "comm_bytes_per_step",
    }
    assert f"{fp32['bytes']['total'] / GiB:.2f}" in out


def test_budget_cli_huge_inputs_and_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            [
                "budget",
                "--params",
                "70B",
                "--policy",
                "bf16_master",
                "--world-size",
                "1024",
                "--json",
            ]
        )
        == 0
    )
    d = json.loads(capsys.readouterr().out)
    assert d["world_size"] == 1024 and d["per_rank"]["moments"] == math.ceil(70e9 / 1024) * 8
    assert main(["budget", "--params", "lots"]) == 2
    assert main(["budget"]) == 2
    assert main(["budget", "--config", "/nonexistent.json"]) == 2
