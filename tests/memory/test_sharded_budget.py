"""Per-rank bytes measured under FSDP2 and DDP equal `mixprec budget --world-size 2`.

Two gloo processes run `sharded_budget_worker.py`: each prepares `sharded_model`
with `mixprec.Precision`, wraps it with ``fully_shard`` (norms in fp32 groups of
their own) or ``DistributedDataParallel``, takes one step and measures what it
holds. The estimate (`mixprec.memory.estimate`, and the CLI with ``--model``) must
give rank 0's bytes exactly, and the sum over both ranks exactly, for params, fp32
islands, grads, masters and moments. Every format here has an exact sharded
layout: masters and dense moments are elementwise, and int8 moments are kept only
where every shard holds whole blocks (per-row scales, or flat scales whose blocks
split on the shard boundary); elsewhere the optimizer keeps fp32 moments, which the
estimate predicts by the same rule (`mixprec.optim.sharding.int8_shards_fit`).
Activations are not compared: under FSDP2 what autograd saves includes the
all-gathered parameters, which the estimate does not count as activations.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import mixprec
from mixprec.cli import main
from mixprec.memory import estimate
from ranks import launch

from . import sharded_model

WORKER = Path(__file__).with_name("sharded_budget_worker.py")
POLICIES = ("fp32", "bf16_master", "bf16_lean")
STATE = ("params", "fp32_islands", "grads", "master", "moments")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("sharded_budget") / "ranks.json"
    launch([str(WORKER), str(out)])
    return json.loads(out.read_text())  # type: ignore[no-any-return]


def _state(d: dict[str, int]) -> dict[str, int]:
    return {k: d[k] for k in STATE}


def _summed(ranks: list[dict[str, Any]], case: str) -> dict[str, int]:
    return {k: sum(r[case]["measure"][k] for r in ranks) for k in STATE}


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["fsdp", "ddp"])
@pytest.mark.parametrize("policy", POLICIES)
def test_measured_rank_bytes_equal_the_estimate(
    ranks: list[dict[str, Any]], policy: str, sharding: str
) -> None:
    case = f"{sharding}/{policy}"
    prec = mixprec.Precision(policy)
    want = estimate(
        prec.prepare(sharded_model.build()), prec.policy, world_size=2, sharding=sharding
    )
    rank0 = ranks[0][case]
    assert _state(rank0["measure"]) == _state(want.per_rank.to_dict())
    assert _summed(ranks, case) == _state(want.all_ranks.to_dict())
    # The optimizer's own walk agrees (params and fp32 islands together).
    held = rank0["training_state"]
    assert held["params"] == want.per_rank.params + want.per_rank.fp32_islands
    assert [held[k] for k in ("grads", "master", "moments")] == [
        getattr(want.per_rank, k) for k in ("grads", "master", "moments")
    ]
    if sharding == "fsdp":  # rank 0 holds the larger share of the odd-row tensors
        assert ranks[1][case]["measure"]["moments"] < rank0["measure"]["moments"]
        assert ranks[1][case]["measure"]["params"] == rank0["measure"]["params"]  # padded
    else:
        assert ranks[1][case]["measure"] == rank0["measure"] | {
            "activations": ranks[1][case]["measure"]["activations"],
            "total": ranks[1][case]["measure"]["total"],
        }


@pytest.mark.slow
def test_int8_moments_that_straddle_shards_are_predicted_fp32(
    ranks: list[dict[str, Any]],
) -> None:
    # proj (34 x 128) is 17 int8 blocks whole but 8.5 per shard: int8 under DDP only.
    def int8(case: str) -> int:
        return sum(m == "int8" for _, m in ranks[0][case]["formats"])

    assert int8("fsdp/bf16_lean") == int8("ddp/bf16_lean") - 1


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["fsdp", "ddp"])
def test_budget_cli_json_for_the_model_equals_what_ranks_hold(
    ranks: list[dict[str, Any]],
    sharding: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    argv = ["budget", "--model", "sharded_model:build", "--policy", ",".join(POLICIES)]
    assert main([*argv, "--world-size", "2", "--sharding", sharding, "--json"]) == 0
    for row in json.loads(capsys.readouterr().out):
        case = f"{sharding}/{row['policy']}"
        assert row["rank"] == 0 and row["world_size"] == 2
        assert _state(row["per_rank"]) == _state(ranks[0][case]["measure"])
        assert _state(row["all_ranks"]) == _summed(ranks, case)
        assert not row["activations_estimated"]
