"""Cases shared by the sharded-AdamW worker and test: params, grads, optimizer options."""

from __future__ import annotations

import torch

from mixprec.optim import AdamW

# (master, moments, fused): fused=True steps each local shard with the native kernel.
CASES = [
    ("exact", "int8", False),
    ("exact", "int8", True),
    ("remainder8", "fp32", True),
    ("kahan", "bf16", True),
    ("stochastic", "int8", False),
    ("stochastic", "bf16", True),
]
#: Shapes: whole int8 blocks per row, rows split unevenly (4/3), 1-D, tiny.
SHAPES = [(64, 256), (7, 512), (33,), (5, 3)]
STEPS = 4
SAVE_AT = 2
BLOCK = 256


def full_params(case: tuple[str, str, bool]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=gen).bfloat16() for s in SHAPES]


def full_grads(case: tuple[str, str, bool], step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return [(torch.randn(s, generator=gen) * 10.0 ** (step % 3 - 2)).bfloat16() for s in SHAPES]


def make_optimizer(case: tuple[str, str, bool], params: list[torch.Tensor]) -> AdamW:
    master, moments, fused = case
    return AdamW(
        params,
        lr=1e-2,
        weight_decay=0.1,
        master=master,
        moments=moments,
        fused=fused,
        seed=7,
        block_size=BLOCK,
        min_int8_numel=0,
    )
