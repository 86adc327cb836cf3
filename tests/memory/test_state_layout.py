"""The analytic optimizer-state layout, pinned to `mixprec.optim.AdamW`'s defaults."""

from __future__ import annotations

import inspect

import pytest
import torch

from mixprec.memory import INT8_BLOCK_SIZE, INT8_MIN_NUMEL, state_nbytes
from mixprec.memory.state_layout import int8_eligible
from mixprec.optim import MASTER_KINDS, AdamW


def test_int8_defaults_are_the_optimizers() -> None:
    defaults = inspect.signature(AdamW.__init__).parameters
    assert defaults["block_size"].default == INT8_BLOCK_SIZE
    assert defaults["min_int8_numel"].default == INT8_MIN_NUMEL


@pytest.mark.parametrize(
    ("master", "per_element"),
    [("none", 0), ("fp32", 4), ("exact", 2), ("remainder8", 1), ("kahan", 2), ("stochastic", 0)],
)
def test_master_bytes_per_element(master: str, per_element: int) -> None:
    got = state_nbytes(1000, param_dtype=torch.bfloat16, master=master, moments="fp32")
    assert got == {"master": 1000 * per_element, "moments": 8 * 1000}


def test_every_master_kind_has_a_layout() -> None:
    for kind in MASTER_KINDS:
        state_nbytes(1, param_dtype=torch.bfloat16, master=kind, moments="bf16")


def test_int8_moments_quantize_large_block_multiples_only() -> None:
    n = INT8_MIN_NUMEL
    big = state_nbytes(n, param_dtype=torch.bfloat16, master="none", moments="int8")
    assert big["moments"] == 2 * n + 2 * 4 * (n // INT8_BLOCK_SIZE)
    small = state_nbytes(n - 1, param_dtype=torch.bfloat16, master="none", moments="int8")
    assert small["moments"] == 8 * (n - 1)
    forced = state_nbytes(
        n - 1, param_dtype=torch.bfloat16, master="none", moments="int8", quantizable=True
    )
    assert forced["moments"] == 2 * (n - 1) + 2 * 4 * -(-(n - 1) // INT8_BLOCK_SIZE)


def test_unknown_formats_are_named() -> None:
    with pytest.raises(ValueError, match="unknown master 'fp64'; valid: none, fp32"):
        state_nbytes(1, param_dtype=torch.bfloat16, master="fp64", moments="fp32")
    with pytest.raises(ValueError, match="unknown moments 'int2'; valid: fp32, bf16, int8, int4"):
        state_nbytes(1, param_dtype=torch.bfloat16, master="none", moments="int2")


def _fits_rank_by_rank(rows: int, row: int, blocks: int, block: int, parts: int) -> bool:
    """The int8 sharding rule written out rank by rank (torch.chunk's row split)."""
    row_step, block_step = -(-rows // parts), -(-blocks // parts)
    return all(
        min(i * row_step, rows) * row == min(i * block_step, blocks) * block
        for i in range(parts + 1)
    )


@pytest.mark.timeout(60)
def test_int8_sharding_rule_is_the_rank_by_rank_one() -> None:
    """`int8_eligible` answers in time independent of the ranks (it walked every rank:
    `mixprec budget --world-size 10**20` never returned) and says what a walk would."""
    seen = set()
    for rows in range(1, 161):
        for row in (1, 32, 64, 96, 160):
            numel = rows * row
            if numel % INT8_BLOCK_SIZE or numel < INT8_MIN_NUMEL:
                continue  # fp32 moments whatever the sharding
            for parts in range(2, 41):
                want = _fits_rank_by_rank(
                    rows, row, numel // INT8_BLOCK_SIZE, INT8_BLOCK_SIZE, parts
                )
                assert int8_eligible((rows, row), parts=parts) == want, (rows, row, parts)
                seen.add(want)
    assert seen == {True, False}
    assert int8_eligible((4096, 96), parts=8)  # 512 rows of 96: 192 whole blocks
    assert not int8_eligible((4096, 96), parts=10**20)  # one row of 96 on rank 0
