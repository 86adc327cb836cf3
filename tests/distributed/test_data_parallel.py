"""FSDP2 and DDP built from a policy, on 2 gloo processes: parity with one process,
the reduce dtype on the wire, rank-consistent skips, and the wrapping order.

One launch of `worker.py` runs every scenario; this process runs the one-process
references (`cases.train` without a wrapper: each rank's slice of the global
batch as a micro-batch, accumulated) and compares.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from . import cases
from .launch import PARALLEL_SCENARIOS, scenario_error

#: With clipping, FSDP2's global norm sums the shards' squares in another order than
#: one process does: the clip coefficient moves by ulps. Under fp32 gradients that
#: stays at ulps; under bf16 gradients a coefficient an ulp apart rounds some
#: clipped gradients to neighbouring bf16 values, and Adam's normalised update turns
#: a flipped tiny gradient into an lr-sized step (lr 3e-3 here, 5 steps).
#: The reported norm itself: torch computes the norm of bf16 gradients in bf16
#: (8 significant bits), per shard under FSDP2, per tensor on one process.
CLIPPED_FSDP_TOLERANCE = {  # policy: (norm rel, loss abs, master abs)
    "fp32": (1e-6, 1e-6, 1e-6),
    "amp_bf16": (1e-6, 1e-6, 1e-6),
    "bf16_master": (1e-2, 5e-3, 2e-2),
    "bf16_lean": (1e-2, 5e-3, 2e-2),
}


@pytest.fixture(scope="module")
def ranks(scenario_results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    error = scenario_error(scenario_results, PARALLEL_SCENARIOS)
    if error:
        pytest.fail(error)
    return scenario_results


@pytest.fixture(autouse=True)
def _one_thread() -> Any:
    """The references run with the workers' one thread: a GEMM's summation order
    depends on the thread count."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _bitwise(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(
        x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b, strict=True)
    )


@pytest.mark.parametrize("policy", cases.POLICIES)
def test_fsdp2_equals_one_process_bitwise_without_clipping(ranks: list, policy: str) -> None:
    ref = cases.train(policy, clip=None)
    got = ranks[0]["fsdp_parity_noclip"][policy]
    assert got["formats"] == ref["formats"]
    assert got["losses"] == ref["losses"]
    assert _bitwise(got["masters"], ref["masters"])


@pytest.mark.parametrize("policy", cases.POLICIES)
def test_fsdp2_with_clipping_matches_one_process_within_the_norm_order(
    ranks: list, policy: str
) -> None:
    ref = cases.train(policy)
    got = ranks[0]["fsdp_parity"][policy]
    norm_tol, loss_tol, master_tol = CLIPPED_FSDP_TOLERANCE[policy]
    # The global norm of sharded gradients is the one-process norm (to its rounding).
    assert got["norms"][0] == pytest.approx(ref["norms"][0], rel=norm_tol)
    assert max(abs(a - b) for a, b in zip(got["losses"], ref["losses"], strict=True)) <= loss_tol
    worst = max(
        float((a - b).abs().max()) for a, b in zip(got["masters"], ref["masters"], strict=True)
    )
    assert worst <= master_tol


@pytest.mark.parametrize("policy", cases.POLICIES)
def test_ddp_equals_one_process_bitwise(ranks: list, policy: str) -> None:
    ref = cases.train(policy)
    got = ranks[0]["ddp_parity"][policy]
    assert got["losses"] == ref["losses"]
    assert got["norms"] == ref["norms"]
    assert _bitwise(got["masters"], ref["masters"])


def test_ddp_hook_in_fp32_is_ddps_own_all_reduce_bit_for_bit(ranks: list) -> None:
    hooked, default = ranks[0]["ddp_parity"]["fp32"], ranks[0]["ddp_default_fp32"]
    assert hooked["losses"] == default["losses"]
    assert _bitwise(hooked["masters"], default["masters"])


def test_the_reduce_dtype_is_what_goes_on_the_wire(ranks: list) -> None:
    for rank in ranks:
        for key, dtypes in rank["payload"].items():
            wanted = key.rsplit("/", 1)[1]
            assert dtypes == [wanted], key  # every gradient collective, both wrappers


def test_wrapping_order(ranks: list) -> None:
    order = ranks[0]["order"]
    for case in ("fully_shard then prepare", "ddp then prepare"):
        message = order[case]
        assert message.startswith("PrecisionError"), case
        assert "before wrapping" in message and "prepare afterwards is then fine" in message
    assert "mixprec.distributed.ddp(model, policy)" in order["raw ddp of a prepared model"]
    assert "reduces them in bf16" in order["raw fully_shard of a prepared model"]
    assert order["shard twice"].startswith("ValueError: shard() takes an unwrapped model")
    a, b = order["prepare then shard"], order["shard then prepare"]
    assert a["losses"] == b["losses"] and _bitwise(a["masters"], b["masters"])


def test_fp32_islands_survive_sharding(ranks: list) -> None:
    order = ranks[0]["order"]
    dtypes = order["island dtypes"]
    assert {d for n, d in dtypes.items() if "norm" in n} == {"torch.float32"}
    assert {d for n, d in dtypes.items() if "norm" not in n} == {"torch.bfloat16"}
    assert order["island forward"] == {"norm": "weight torch.float32, input torch.float32"}


def _same(a: tuple, b: tuple) -> bool:
    return all(
        (isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y))
        or x == y
        for x, y in zip(a, b, strict=True)
    )


def test_every_rank_skips_the_same_steps_and_reports_the_same(ranks: list) -> None:
    first, second = ranks[0]["skips"], ranks[1]["skips"]
    assert len(first) == 12  # 2 policies x 2 wrappers x 3 injection points
    for key, run in first.items():
        other = second[key]
        applied = [r[0] for r in run["reports"]]
        assert not applied[2], key  # the injected step is skipped ...
        assert applied[3:] == [True, True], key  # ... and training goes on
        assert all(_same(a, b) for a, b in zip(run["reports"], other["reports"], strict=True))
        assert run["reports"][2][1] > 0, key  # the non-finite count, the same everywhere
        assert _bitwise(run["params"], other["params"]), key


def test_a_collective_load_called_differently_on_some_rank_is_refused_on_all(
    ranks: list,
) -> None:
    for rank in ranks:
        found = rank["load_mismatch"]
        assert "rank(s) [1] differ from rank 0 in resume (rank 0: resume=1)" in found["resume"]
        assert "differ from rank 0 in optimizer" in found["optimizer"]
        assert found["same"] == 2
