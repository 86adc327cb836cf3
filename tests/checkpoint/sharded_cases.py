"""The run shared by the sharded-checkpoint worker (2 gloo ranks) and its test (1 process).

The worker imports this file by path, so it depends on nothing but mixprec and torch.
Every rank trains on its own contiguous slice of one fixed global batch per step; a
single process trains on the whole batch.
"""

from __future__ import annotations

import random
import warnings

import numpy as np
import torch
from torch import nn

import mixprec

GLOBAL_BATCH = 32
SAVE_AT = 3
STEPS = 6
LR = 3e-3


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def make_model() -> nn.Module:
    """Linear layers (bf16 under bf16_master) around a LayerNorm island (fp32)."""
    gen_state = torch.get_rng_state()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.ReLU(), nn.Linear(64, 8))
    torch.set_rng_state(gen_state)
    return model


def build(
    policy: str, wrap: str = "none"
) -> tuple[nn.Module, torch.optim.Optimizer, mixprec.Precision]:
    """The prepared model (`wrap`: ``none``, ``fsdp`` or ``ddp``), its optimizer and
    `Precision`."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prec = mixprec.Precision(policy)
        model = prec.prepare(make_model())
        if wrap == "fsdp":
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            low = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            island = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
            for module in model:
                if isinstance(module, nn.Linear):
                    fully_shard(module, mp_policy=low)
                elif isinstance(module, nn.LayerNorm):  # one dtype per FSDP2 group
                    fully_shard(module, mp_policy=island)
            fully_shard(model, mp_policy=low)
        optimizer = prec.optimizer(model, lr=LR, weight_decay=0.1)
        if wrap == "ddp":
            model = nn.parallel.DistributedDataParallel(model)
    return model, optimizer, prec


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL_BATCH, 16, generator=g), torch.randint(
        0, 8, (GLOBAL_BATCH,), generator=g
    )


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    prec: mixprec.Precision,
    start: int,
    stop: int,
    *,
    rank: int = 0,
    world: int = 1,
) -> list[float]:
    """Steps `start..stop-1` on this rank's slice; the loss of each step over the
    whole global batch (the mean of the ranks' slice losses)."""
    losses = []
    for step in range(start, stop):
        x, y = batch(step)
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        with prec.autocast():
            loss = nn.functional.cross_entropy(model(x).float(), y)
        prec.backward(loss)
        prec.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        value = loss.detach().clone()
        if world > 1:
            torch.distributed.all_reduce(value)
            value /= world
        losses.append(value.item())
    return losses


def gathered(t: torch.Tensor) -> torch.Tensor:
    full = getattr(t, "full_tensor", None)
    return (full() if full is not None else t).detach().clone()


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Whole parameters and masters by name (a collective under FSDP2)."""
    inner = getattr(model, "module", model)
    names = [n for n, _ in inner.named_parameters()]
    out = {f"param/{n}": gathered(p) for n, p in zip(names, inner.parameters(), strict=True)}
    masters = optimizer.master_weights()  # type: ignore[operator]
    out.update({f"master/{n}": gathered(m) for n, m in zip(names, masters, strict=True)})
    return out


def probe() -> list[float]:
    """One draw from each global RNG (to check which streams a load restored)."""
    return [torch.rand(1).item(), random.random(), float(np.random.rand())]
