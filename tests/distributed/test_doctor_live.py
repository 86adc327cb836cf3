"""`mixprec.doctor.check` on live FSDP2 and DDP models, on 2 gloo processes: the facts
come from what the wrappers do (`mixprec.engine.wrappers.reductions`), not the policy."""

from __future__ import annotations

from typing import Any

import pytest

from . import cases
from .launch import DOCTOR_SCENARIO, scenario_error

#: Parameter elements of `cases.Net`'s LayerNorms (one per block and a final one, weight
#: and bias each): fp32 islands; the rest is stored in bf16 under bf16_master.
NORMS = sum(p.numel() for n, p in cases.make_model().named_parameters() if "norm" in n)


@pytest.fixture(scope="module")
def ranks(scenario_results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    error = scenario_error(scenario_results, (DOCTOR_SCENARIO,))
    if error:
        pytest.fail(error)
    return [rank[DOCTOR_SCENARIO] for rank in scenario_results]


def _only(findings: list[dict[str, Any]], rule: str) -> dict[str, Any]:
    assert [f["rule"] for f in findings] == [rule], findings
    return findings[0]


def test_shard_with_a_policy_is_clean_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        assert rank["shard bf16_master"] == []


def test_fsdp2_groups_reducing_in_bf16_are_reduce_dtype_16bit(
    ranks: list[dict[str, Any]],
) -> None:
    for rank in ranks:
        f = _only(rank["shard bf16 reduce"], "reduce-dtype-16bit")
        ev = f["evidence"]
        assert f["severity"] == "warning" and ev["wrapper"] == "fsdp2"
        # Every group reduces in bf16, the fp32 islands' groups too: all trainable elements.
        assert ev["groups_16bit"] == ev["groups_total"] == 6  # 3 norms, 2 blocks, root
        assert ev["grad_elements_16bit"] == rank["numel"]
        assert ev["grad_bytes_saved_per_step"] == 2 * rank["numel"]
        assert "8 significant bits" in f["message"]
    assert ranks[0]["shard bf16 reduce"] == ranks[1]["shard bf16 reduce"]


def test_raw_fully_shard_without_a_policy_is_fsdp_without_mixed_precision(
    ranks: list[dict[str, Any]],
) -> None:
    for rank in ranks:
        f = _only(rank["raw fully_shard amp_bf16"], "fsdp-without-mixed-precision")
        ev = f["evidence"]
        assert ev["groups_default_policy"] == 3 and ev["numel"] == rank["numel"]
        assert ev["all_gather_bytes_per_step"] == 2 * rank["numel"] * 4
        assert ev["compute_dtype"] == "bf16" and ev["param_dtype"] == "fp32"
        assert "mixprec.distributed.shard(model, policy)" in f["fix"]


def test_raw_ddp_of_bf16_params_reduces_them_in_bf16(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        f = _only(rank["raw ddp bf16_master"], "reduce-dtype-16bit")
        ev = f["evidence"]
        assert ev["wrapper"] == "ddp" and ev["mixprec_hook"] is False
        assert ev["policy_reduce_dtype"] == "fp32"
        assert ev["grad_elements_16bit"] == rank["numel"] - NORMS
        assert ev["wire_bytes_saved_per_rank_per_step"] == 2 * 2 * (rank["numel"] - NORMS)
        assert "mixprec.distributed.ddp(model, policy)" in f["fix"]
