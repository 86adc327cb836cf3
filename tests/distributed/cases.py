"""The model, data and training loop shared by the distributed worker and the tests.

`train` runs the same loop on one process (the reference: the global batch as
one micro-batch per rank's slice, accumulated) and on every rank of a group
(each rank its own slice, FSDP2 or DDP reducing), so the two can be compared
step by step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import mixprec

WORLD = 2
STEPS = 5
ROWS_PER_RANK = 4
FEATURES = 16
CLASSES = 10
#: Policies of the parity cases.
POLICIES = ("fp32", "amp_bf16", "bf16_master", "bf16_lean")


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class Net(nn.Module):
    """A small residual net with blocks in a ModuleList (what `shard` wraps) and norms."""

    def __init__(self, d: int = 64, depth: int = 2) -> None:
        super().__init__()
        self.inp = nn.Linear(FEATURES, d)
        self.layers = nn.ModuleList(Block(d) for _ in range(depth))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


def make_model() -> Net:
    torch.manual_seed(0)
    return Net()


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s slice of the global batch of `step`."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(ROWS_PER_RANK, FEATURES, generator=gen) * 3
    y = torch.randint(0, CLASSES, (ROWS_PER_RANK,), generator=gen)
    return x, y


def loss_of(prec: mixprec.Precision, model: nn.Module, x: torch.Tensor, y: torch.Tensor):
    with prec.autocast():
        out = model(x)
    return torch.nn.functional.cross_entropy(out.float(), y)


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (a collective), else a copy."""
    full_tensor = getattr(t, "full_tensor", None)
    return (full_tensor() if full_tensor is not None else t).detach().clone()


def train(
    policy: str,
    *,
    wrap: Callable[[nn.Module, mixprec.Precision], nn.Module] | None = None,
    steps: int = STEPS,
    clip: float | None = 1.0,
    policy_obj: mixprec.Policy | None = None,
) -> dict[str, Any]:
    """Train `steps` steps under `policy`; on one process when `wrap` is None (each
    rank's slice as a micro-batch), else on every rank with `wrap` applied."""
    prec = mixprec.Precision(policy_obj or policy)
    model = make_model()
    if wrap is not None:
        model = wrap(model, prec)
    model = prec.prepare(model)
    opt = prec.optimizer(model, lr=3e-3, weight_decay=0.1)
    rank = dist.get_rank() if wrap is not None else 0
    losses, norms, applied = [], [], []
    for step in range(steps):
        if wrap is None:  # one process: the ranks' slices as accumulated micro-batches
            summed = torch.zeros(())
            for r in range(WORLD):
                loss = loss_of(prec, model, *batch(step, r))
                prec.backward(loss / WORLD)
                summed += loss.detach() / WORLD  # as the ranks' all-reduce adds them
            total = float(summed)
        else:
            loss = loss_of(prec, model, *batch(step, rank))
            prec.backward(loss)
            t = loss.detach().clone() / WORLD
            dist.all_reduce(t)
            total = float(t)
        if clip is not None:
            prec.clip_grad_norm_(model.parameters(), clip)
        report = prec.step(opt)
        opt.zero_grad(set_to_none=True)
        losses.append(total)
        norms.append(report.grad_norm)
        applied.append(report.applied)
    masters = [full(m) for m in opt.master_weights()]
    return {
        "losses": losses,
        "norms": norms,
        "applied": applied,
        "masters": masters,
        "params": {n: full(p) for n, p in model.named_parameters()},
        "formats": [str(f) for f in opt.formats()],
    }
