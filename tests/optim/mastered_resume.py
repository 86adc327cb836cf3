"""`Mastered` through `mixprec.checkpoint`: the run of `tests.checkpoint.loop` (dropout,
clipping, Python and NumPy draws) with a torch optimizer class given to `prec.optimizer`.

``python -m tests.optim.mastered_resume ROOT STEPS OUT`` (from the repository root)
loads ROOT's checkpoint in a new process, trains to STEPS and writes the losses and
the state to OUT.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from tests.checkpoint import loop
from torch import nn

import mixprec
from mixprec import checkpoint

OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "sgd": (torch.optim.SGD, {"lr": 3e-2, "momentum": 0.9, "nesterov": True}),
    "adam": (torch.optim.Adam, {"lr": 3e-3, "weight_decay": 0.1}),
    "adafactor": (torch.optim.Adafactor, {"lr": 1e-2}),
}


def build(name: str) -> tuple[nn.Module, torch.optim.Optimizer, mixprec.Precision]:
    cls, kwargs = OPTIMIZERS[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prec = mixprec.Precision("bf16_master")
        model = prec.prepare(loop.make_model())
        optimizer = prec.optimizer(model, optimizer=cls, scratch_bytes=16 * 1024, **kwargs)
    return model, optimizer, prec


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Parameters, masters and every optimizer state tensor (the inner one's too)."""
    out = {f"param/{n}": p.detach().clone() for n, p in model.named_parameters()}
    masters = optimizer.master_weights()  # type: ignore[operator]
    for (n, _), m in zip(model.named_parameters(), masters, strict=True):
        out[f"master/{n}"] = m
    names = [n for n, _ in model.named_parameters()]
    for index, state in optimizer.state_dict()["state"].items():
        for key, value in state.items():
            out[f"state/{names[index]}/{key}"] = torch.as_tensor(value).detach().clone()
    return out


def run_then_save(name: str, root: Path, steps: int) -> list[float]:
    loop.seed_everything()
    model, optimizer, prec = build(name)
    losses = loop.train(model, optimizer, prec, 0, steps)
    checkpoint.save(root, model=model, optimizer=optimizer, precision=prec, step=steps)
    return losses


def main() -> None:
    torch.set_num_threads(1)
    root, steps, out = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    results = {}
    for name in OPTIMIZERS:
        loop.seed_everything(7)  # a different state: the checkpoint must restore it
        model, optimizer, prec = build(name)
        start = checkpoint.load(root / name, model=model, optimizer=optimizer, precision=prec)
        losses = loop.train(model, optimizer, prec, start["step"], steps)
        results[name] = {
            "losses": torch.tensor(losses, dtype=torch.float64),
            **snapshot(model, optimizer),
        }
    torch.save(results, out)


if __name__ == "__main__":
    main()
