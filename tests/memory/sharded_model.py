"""A small language model whose shapes exercise FSDP2's dim-0 sharding over 2 ranks.

Shared by `sharded_budget_worker.py` (the measured side) and `mixprec budget --model
sharded_model:build` (the predicted side). Rows per tensor (2 ranks):

* even rows that split into whole int8 blocks: ``up`` (384 x 128, flat scales),
  ``down`` (128 x 384, flat scales), ``wide`` (256 x 128);
* odd rows (rank 0 holds one more row, FSDP2 pads rank 1): ``embed`` (65 x 128),
  ``narrow`` (33 x 256: per-row int8 scales), ``head`` (65 x 33), biases of 33 and 65;
* ``proj`` (34 x 128): 17 int8 blocks unsharded, but each half is 8.5 blocks, so the
  sharded optimizer keeps fp32 moments for it;
* LayerNorms: fp32 islands under 16-bit policies.
"""

from __future__ import annotations

import torch
from torch import nn

VOCAB, DIM, HIDDEN, SEQ, BATCH = 65, 128, 384, 8, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(DIM)
        self.wide = nn.Linear(DIM, 256)
        self.narrow = nn.Linear(256, 33)
        self.head = nn.Linear(33, VOCAB)
        self.proj = nn.Linear(DIM, 34, bias=False)

    def forward(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)
        return self.head(self.narrow(torch.relu(self.wide(x)))), self.proj(x)


def build() -> nn.Module:
    """The model with seeded weights (the same on every rank)."""
    torch.manual_seed(0)
    return TinyLM()


def batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's micro-batch of token ids and targets."""
    g = torch.Generator().manual_seed(rank)
    idx = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def loss_fn(out: tuple[torch.Tensor, torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
    logits, aux = out
    ce = nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    return ce + 1e-3 * aux.float().pow(2).mean()
