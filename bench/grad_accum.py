"""Gradient accumulation under bf16 storage: error of the summed gradient, and cost.

A small GPT (the built-in workload's model) under ``bf16_master`` accumulates N
micro-batches (8, 64, 256) with and without ``grad_accum_dtype=fp32``. The
reference is the float64 sum of each micro-batch's gradient (``torch.autograd.grad``
on the same prepared model: the values autograd hands to ``.grad``). Printed per
N: the relative 2-norm error of ``.grad`` over the 16-bit parameters, and that of
the reference rounded once to bf16 (the floor any bf16 ``.grad`` has). Then the
step time (N micro-batches, forward, backward and ``prec.step``) with and without
the field, interleaved over repeats, best of each, and their ratio, in wall and
process time.

Run: ``OMP_NUM_THREADS=1 python bench/grad_accum.py [--device cuda] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings

import torch
from torch import nn

from mixprec import Precision, preset
from mixprec.workloads.gpt import GPT, GPTConfig

CONFIG = GPTConfig(vocab_size=65, block_size=32, n_layer=2, n_head=4, n_embd=64)
BATCH, SEQ = 4, 32


def _model(device: str) -> nn.Module:
    torch.manual_seed(0)
    return GPT(CONFIG).to(device)


def _batches(n: int, device: str, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        idx = torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ + 1), generator=g).to(device)
        out.append((idx[:, :-1], idx[:, 1:]))
    return out


def _loss(
    prec: Precision, model: nn.Module, x: torch.Tensor, y: torch.Tensor, n: int
) -> torch.Tensor:
    with prec.autocast():
        logits = model(x)
    return nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten()) / n


def errors(n: int, fp32_sum: bool, device: str) -> dict[str, float]:
    pol = preset("bf16_master")
    if fp32_sum:
        pol = pol.replace(grad_accum_dtype=torch.float32)
    prec = Precision(pol)
    model = prec.prepare(_model(device))
    data = _batches(n, device)
    params = [p for p in model.parameters() if p.dtype == torch.bfloat16]
    ref = [torch.zeros_like(p, dtype=torch.float64) for p in params]
    for x, y in data:
        for r, g in zip(ref, torch.autograd.grad(_loss(prec, model, x, y, n), params), strict=True):
            r += g.double()
    for x, y in data:
        prec.backward(_loss(prec, model, x, y, n))
    norm = sum(float((r**2).sum()) for r in ref) ** 0.5
    err = sum(float(((p.grad.double() - r) ** 2).sum()) for p, r in zip(params, ref, strict=True))
    floor = sum(float(((r.to(torch.bfloat16).double() - r) ** 2).sum()) for r in ref)
    return {"relative_error": err**0.5 / norm, "one_rounding": floor**0.5 / norm}


def step_times(n: int, repeats: int, device: str) -> dict[str, dict[str, float]]:
    runs = {}
    for name, fp32_sum in (("bf16 .grad", False), ("fp32 sums", True)):
        pol = preset("bf16_master")
        if fp32_sum:
            pol = pol.replace(grad_accum_dtype=torch.float32)
        prec = Precision(pol)
        model = prec.prepare(_model(device))
        runs[name] = (prec, model, prec.optimizer(model, lr=1e-4))
    data = _batches(n, device, seed=2)
    best: dict[str, dict[str, float]] = {k: {"wall": 1e9, "cpu": 1e9} for k in runs}
    for i in range(repeats + 1):
        for name, (prec, model, opt) in runs.items():
            if device == "cuda":
                torch.cuda.synchronize()
            w, c = time.perf_counter(), time.process_time()
            for x, y in data:
                prec.backward(_loss(prec, model, x, y, n))
            prec.step(opt)
            opt.zero_grad()
            if device == "cuda":
                torch.cuda.synchronize()
            if i:  # the first round warms up (state made at the first step)
                best[name]["wall"] = min(best[name]["wall"], time.perf_counter() - w)
                best[name]["cpu"] = min(best[name]["cpu"], time.process_time() - c)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    out: dict[str, object] = {
        "device": args.device,
        "params": sum(p.numel() for p in _model("cpu").parameters()),
    }
    for n in (8, 64, 256):
        out[f"errors_{n}"] = {
            "bf16 .grad": errors(n, False, args.device),
            "fp32 sums": errors(n, True, args.device),
        }
    for n in (1, 8):
        out[f"step_seconds_{n}"] = step_times(n, args.repeats, args.device)
    if args.json:
        print(json.dumps(out, indent=1))
        return
    print(f"GPT {out['params']:,} params, micro-batch {BATCH}x{SEQ}, {args.device}")
    for n in (8, 64, 256):
        e = out[f"errors_{n}"]
        assert isinstance(e, dict)
        a, b = e["bf16 .grad"], e["fp32 sums"]
        print(
            f"N={n:3d}: bf16 .grad {a['relative_error']:.3%}  fp32 sums {b['relative_error']:.3%}"
            f"  (one rounding {b['one_rounding']:.3%})"
        )
    for n in (1, 8):
        t = out[f"step_seconds_{n}"]
        assert isinstance(t, dict)
        a, b = t["bf16 .grad"], t["fp32 sums"]
        print(
            f"step of {n} micro-batches: bf16 .grad {a['wall'] * 1e3:.1f} ms, fp32 sums "
            f"{b['wall'] * 1e3:.1f} ms (x{b['wall'] / a['wall']:.3f} wall, "
            f"x{b['cpu'] / a['cpu']:.3f} cpu)"
        )


if __name__ == "__main__":
    main()
