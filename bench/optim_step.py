"""Optimizer step benchmark: mixprec AdamW formats against torch, torchao and optimi.

Run with OMP_NUM_THREADS=2, e.g. ``python bench/optim_step.py --sizes 16M,64M --steps 5``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from mixprec.optim import AdamW, training_state_bytes


def _size(text: str) -> int:
    return int(float(text.rstrip("M")) * 2**20) if text.endswith("M") else int(text)


def _time(fn: Callable[[], object], steps: int) -> tuple[float, float]:
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return first, min(times)


def _copy_bandwidth(n: int) -> float:
    x = torch.randn(n)
    _, t = _time(lambda: x.mul_(1.0), 5)
    return 8 * n / t / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="16M,64M")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="few combinations, 1M params")
    args = parser.parse_args()
    sizes = [_size("1M")] if args.quick else [_size(s) for s in args.sizes.split(",")]
    combos = (
        [("exact", "fp32"), ("remainder8", "int8")]
        if args.quick
        else [
            (m, mo)
            for m in ("none", "fp32", "exact", "remainder8", "kahan", "stochastic")
            for mo in ("fp32", "bf16", "int8")
        ]
    )
    for n in sizes:
        bw = _copy_bandwidth(n)
        print(f"\n## {n / 2**20:.0f}M params, in-place copy bandwidth {bw:.1f} GB/s")
        print("| optimizer | step ms | ratio | bytes/param | GB/s | first step s |")
        print("| --- | --- | --- | --- | --- | --- |")
        p = torch.randn(n, requires_grad=True)
        p.grad = torch.randn(n)
        ref = torch.optim.AdamW([p], fused=True)
        first, ref_t = _time(ref.step, args.steps)
        per = training_state_bytes(ref)["total"] / n
        gbs = 28 * n / ref_t / 1e9
        cells = [f"{ref_t * 1e3:.1f}", "1.00", f"{per:.2f}", f"{gbs:.1f}", f"{first:.2f}"]
        print("| torch fused fp32 | " + " | ".join(cells) + " |")
        for master, moments in combos:
            q = torch.randn(n).bfloat16().requires_grad_()
            q.grad = torch.randn(n).bfloat16()
            opt = AdamW([q], master=master, moments=moments, fused=True)
            first, t = _time(opt.step, args.steps)
            per = training_state_bytes(opt)["total"] / n
            cells = [f"{t * 1e3:.1f}", f"{t / ref_t:.2f}", f"{per:.2f}", "-", f"{first:.2f}"]
            print(f"| {master}+{moments} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
