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
    ("exact", "int4", False),
    ("remainder8", "int4", True),
]
#: The int4 cases (rank-1 column maxima reduced across ranks every step).
INT4_CASES = [c for c in CASES if c[1] == "int4"]
#: Shapes: int8 with per-row scales (one block per row; two per row, rows split
#: 4/3), int8 with flat scales whose blocks fall on the 4/4 row split (8 x 64:
#: one 256-element block per shard), 1-D and tiny (fp32 moments).
#: int4: the first two (rows of whole 128-blocks, the second split 4/3) and one row
#: (all on rank 0, none on rank 1).
SHAPES = [(64, 256), (7, 512), (8, 64), (33,), (5, 3), (1, 256)]
#: Flat scales whose blocks straddle the 6/6 row split (768 elements, 3 blocks):
#: int8 unsharded, fp32 moments when sharded on 2 ranks.
UNALIGNED_SHAPE = (12, 64)
STEPS = 4
SAVE_AT = 2
BLOCK = 256


class Holder(torch.nn.Module):
    """The case's parameters as a module (for torch.distributed.checkpoint's state dicts)."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        super().__init__()
        self.ps = torch.nn.ParameterList(params)


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


def fsdp_model() -> torch.nn.Module:
    """The small bf16 MLP of the fully_shard case (same weights on every rank)."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64)]
    return torch.nn.Sequential(*layers).to(torch.bfloat16)


def fsdp_batch(step: int) -> torch.Tensor:
    """The batch of `step`: the same on every rank, so averaged gradients equal local ones."""
    return torch.randn(16, 64, generator=torch.Generator().manual_seed(step)).bfloat16()


def fsdp_optimizer(params: list[torch.Tensor]) -> AdamW:
    # Weights (256 x 64: flat scales, 64 x 256: per-row scales) get int8 moments.
    return AdamW(params, lr=1e-2, master="exact", moments="int8", fused=True)


def fsdp_train(model: torch.nn.Module, opt: AdamW, steps: int) -> list[float]:
    losses = []
    for step in range(steps):
        loss = model(fsdp_batch(step)).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses
