"""Muon as users run it, with exact masters over bf16 storage (docs/mastered.md).

The built-in ``shakespeare`` GPT: its 2-D hidden weights (attention and MLP matrices)
train with ``torch.optim.Muon`` under `mixprec.optim.Mastered`, everything else
(embeddings and the tied head, norms, biases) with `mixprec.optim.AdamW`; both keep
bitwise-fp32 masters of bf16 parameters and step in one `Precision` step.

    python examples/muon.py [STEPS]
"""

from __future__ import annotations

import sys

import torch

import mixprec
from mixprec.workloads import load_workload


def is_hidden(name: str, p: torch.Tensor) -> bool:
    """Muon's parameters: the 2-D weights inside the transformer blocks."""
    return p.ndim == 2 and name.startswith("blocks.")


def main(steps: int = 60, size: str = "tiny") -> list[float]:
    """Train `steps` steps; the training losses."""
    workload = load_workload("shakespeare", size=size)
    prec = mixprec.Precision("bf16_master")
    model = prec.prepare(workload.make_model(0))
    named = list(model.named_parameters())
    muon = prec.optimizer(
        [p for n, p in named if is_hidden(n, p)],
        optimizer=torch.optim.Muon,
        lr=0.02,
        weight_decay=0.01,
    )
    adamw = prec.optimizer([p for n, p in named if not is_hidden(n, p)], lr=3e-3)
    losses = []
    for step in range(steps):
        inputs, targets = workload.train_batch(step=step, seed=0, batch_size=16, device="cpu")
        with prec.autocast():
            loss = workload.loss(model(inputs), targets)
        prec.backward(loss)
        prec.clip_grad_norm_(model.parameters(), 1.0)
        prec.step([muon, adamw])
        muon.zero_grad(set_to_none=True)
        adamw.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


if __name__ == "__main__":
    losses = main(int(sys.argv[1]) if len(sys.argv) > 1 else 60)
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps")
