"""Bytes per parameter by component for each update rule and format, measured and predicted.

For every rule of `mixprec.optim.rules.RULES` (picked by its optimizer and
arguments) and every storage setup (bf16 parameters with an exact master and fp32,
bf16 or int8 moments; bf16 parameters without a master; fp32 parameters), one
optimizer steps a stack of bias-free 1024x1024 linears (no norms: every tensor is
large, a multiple of the int8 block) three times; `mixprec.memory.measure` reads the
third step's params, grads, master and moments, and `mixprec.memory.estimate`
predicts them for the same policy and optimizer (`mixprec budget --optimizer NAME
--optimizer-args ...` prints the same prediction). Prints a markdown table: bytes
per parameter of each component, and whether every component matches.

Run: ``PYTHONPATH=src python bench/rule_memory.py`` (a few seconds per row on a CPU).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

import mixprec.optim
from mixprec.memory import estimate, measure
from mixprec.policy import preset

#: (optimizer, its arguments) for each rule.
OPTIMIZERS: list[tuple[str, dict[str, Any]]] = [
    ("AdamW", {}),
    ("AdamW", {"amsgrad": True}),
    ("Adam", {"amsgrad": True}),
    ("SGD", {}),
    ("SGD", {"momentum": 0.9}),
    ("SGD", {"momentum": 0.9, "nesterov": True}),
    ("Lion", {}),
]
#: (label, base preset, master, moments).
SETUPS = [
    ("bf16 + exact, fp32 moments", "bf16_master", "exact", "fp32"),
    ("bf16 + exact, bf16 moments", "bf16_master", "exact", "bf16"),
    ("bf16 + exact, int8 moments", "bf16_master", "exact", "int8"),
    ("bf16, no master, bf16 moments", "bf16_pure", "none", "bf16"),
    ("fp32, fp32 moments", "fp32", "none", "fp32"),
]
COMPONENTS = ("params", "grads", "master", "moments")


def row(cls: str, args: dict[str, Any], label: str, base: str, master: str, moments: str) -> str:
    torch.manual_seed(0)
    pol = dataclasses.replace(preset(base), master=master, moments=moments)
    model = nn.Sequential(*[nn.Linear(1024, 1024, bias=False) for _ in range(4)])
    model.to(pol.param_dtype)
    x = torch.randn(8, 1024, dtype=pol.param_dtype)
    opt = getattr(mixprec.optim, cls)(
        model.parameters(), lr=1e-4, master=master, moments=moments, **args
    )

    def step() -> None:
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    got = measure(model, opt, step, policy=pol).bytes
    want = estimate(model, pol, optimizer=cls.lower(), optimizer_args=args)
    n = sum(p.numel() for p in model.parameters())
    cells = [getattr(got, c) / n for c in COMPONENTS]
    same = all(getattr(got, c) == getattr(want.bytes, c) for c in COMPONENTS)
    given = ", ".join(f"{k}={v}" for k, v in args.items())
    return (
        f"| {cls}({given}) | {want.rule} | {label} | "
        + " | ".join(f"{v:.3f}".rstrip("0").rstrip(".") for v in cells)
        + f" | {sum(cells):.3f}".rstrip("0").rstrip(".")
        + f" | {'yes' if same else 'NO'} |"
    )


def main() -> None:
    print("| optimizer | rule | storage | params | grads | master | moments | total | = budget |")
    print("|---|---|---|---|---|---|---|---|---|")
    for cls, args in OPTIMIZERS:
        for label, base, master, moments in SETUPS:
            print(row(cls, args, label, base, master, moments), flush=True)


if __name__ == "__main__":
    main()
