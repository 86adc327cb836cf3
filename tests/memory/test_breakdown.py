"""The components of a breakdown (which parameters are fp32 islands: tests/test_islands.py)."""

from __future__ import annotations

from mixprec.memory import COMPONENTS, Components, MemoryBreakdown


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
