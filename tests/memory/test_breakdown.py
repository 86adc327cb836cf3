"""The components of a breakdown (which parameters are fp32 islands: tests/test_islands.py)."""

from __future__ import annotations

import pytest

from mixprec.memory import COMPONENTS, Components, MemoryBreakdown, format_bytes


def test_components_sum_and_serialize_in_report_order() -> None:
    a = Components(params=1, grads=2, activations=4)
    b = Components(master=8, moments=16, fp32_islands=32)
    both = a + b
    assert both.total == 63
    assert list(both.to_dict()) == [*COMPONENTS, "total"]
    assert both.to_dict()["total"] == 63


def test_state_bytes_per_param_counts_sharded_state_once() -> None:
    rank = Components(params=2, grads=2, master=2, moments=8, activations=100)
    both = rank + rank
    fsdp = MemoryBreakdown(
        policy="p", params=4, world_size=2, sharding="fsdp", bytes=both, per_rank=rank
    )
    ddp = MemoryBreakdown(
        policy="p", params=4, world_size=2, sharding="ddp", bytes=both, per_rank=rank
    )
    assert fsdp.state_bytes_per_param == 14 * 2 / 4
    assert ddp.state_bytes_per_param == 14 / 4
    assert fsdp.all_ranks == both
    assert fsdp.comm_bytes_per_step_all_ranks == {}
    d = fsdp.to_dict()
    assert set(d) >= {"policy", "bytes", "per_rank", "all_ranks", "rank", "comm_bytes_per_step"}
    assert d["all_ranks"] == d["bytes"] == both.to_dict() and d["rank"] == 0


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.00 KiB"),
        (4000, "3.91 KiB"),
        (150 * 2**20, "150 MiB"),
        (13 * 2**30 + 2**29, "13.5 GiB"),
        (2**40, "1.00 TiB"),
        (2**70, "1024 EiB"),  # past the last unit: it grows
    ],
)
def test_format_bytes_picks_a_unit_per_value(n: int, text: str) -> None:
    assert format_bytes(n) == text


def test_buffers_are_not_training_state() -> None:
    state = Components(params=2, grads=2, master=2, moments=8)
    held = state + Components(buffers=100)
    one = MemoryBreakdown(policy="x", params=1, bytes=held, per_rank=held)
    assert one.state_bytes_per_param == state.total == 14
