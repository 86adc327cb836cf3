"""The analytic estimate: closed-form totals, sharding and communication, argument errors."""

from __future__ import annotations

import pytest

from mixprec.memory import estimate

from .gpt import GiB


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


def test_grad_accum_counts_the_fp32_sums_the_engine_holds() -> None:
    """Issue 30: the fp32 sums of Policy.grad_accum_dtype are memory; the estimate
    counts what the engine holds during accumulation (16-bit params only: not the
    LayerNorm island, not the frozen layer)."""
    import torch
    from torch import nn

    from mixprec import Precision, preset

    pol = preset("bf16_master").replace(grad_accum_dtype=torch.float32)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 4), nn.Linear(4, 4))
    model[3].requires_grad_(False)
    predicted = estimate(model, pol)
    assert estimate(model, "bf16_master").per_rank.grad_accum == 0
    prec = Precision(pol)
    prec.prepare(model)
    for _ in range(2):
        with prec.autocast():
            prec.backward(model(torch.randn(8, 16)).float().sum())
    held = prec._accumulation.nbytes
    assert held == predicted.per_rank.grad_accum == 4 * (16 * 32 + 32 + 32 * 4 + 4)
    assert estimate(7_000_000, pol).state_bytes_per_param == 18  # 14 + 4
    assert estimate(7_000_000, pol, world_size=2, sharding="ddp").per_rank.grad_accum > 0
    with pytest.raises(ValueError, match="refused under FSDP2"):
        estimate(7_000_000, pol, world_size=2, sharding="fsdp")
