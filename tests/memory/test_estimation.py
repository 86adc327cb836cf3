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
