"""What `Precision.step`'s non-finite check costs per step, against the bare optimizer step.

The check is one fused norm over every gradient the optimizers hold plus one host
sync. Measured here on a GPT-sized parameter set with `torch.optim.AdamW` (the
peer) under the fp32 policy, with and without a clip before the step, in one run:

    OMP_NUM_THREADS=2 python bench/step_check.py [--params 10e6] [--steps 30]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from mixprec import Precision, device_caps


def _median_ms(fn: object, steps: int) -> float:
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - t0)
    return statistics.median(times[3:] if len(times) > 6 else times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--params", type=float, default=10e6, help="total parameter elements")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    n = int(args.params)
    torch.manual_seed(0)
    # A transformer-like mix: a few large matrices and many small vectors.
    shapes = [(1024, (n // 8) // 1024)] * 8 + [(1024,)] * 48
    params = [torch.nn.Parameter(torch.randn(*s) * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt = torch.optim.AdamW(params, lr=1e-4, foreach=True)
    prec = Precision("fp32")
    prec.register(opt)

    bare = _median_ms(opt.step, args.steps)
    checked = _median_ms(lambda: prec.step(opt), args.steps)

    def clip_then_step() -> None:
        prec.clip_grad_norm_(params, 1e9)
        prec.step(opt)

    def clip_then_bare() -> None:
        torch.nn.utils.clip_grad_norm_(params, 1e9)
        opt.step()

    clipped = _median_ms(clip_then_step, args.steps)
    clipped_bare = _median_ms(clip_then_bare, args.steps)
    total = sum(p.numel() for p in params)
    caps = device_caps("cpu")
    print(
        f"cpu: {caps.name} ({platform.machine()}), torch {torch.__version__}, "
        f"threads {torch.get_num_threads()}, {total / 1e6:.1f}M params in {len(params)} tensors"
    )
    print(f"{'loop':<34}{'ms/step':>10}{'vs peer':>10}")
    print(f"{'torch AdamW.step (peer)':<34}{bare:>10.2f}{1.0:>10.3f}")
    print(f"{'prec.step(AdamW)':<34}{checked:>10.2f}{checked / bare:>10.3f}")
    print(f"{'torch clip + AdamW.step (peer)':<34}{clipped_bare:>10.2f}{1.0:>10.3f}")
    print(
        f"{'prec.clip_grad_norm_ + prec.step':<34}{clipped:>10.2f}{clipped / clipped_bare:>10.3f}"
    )


if __name__ == "__main__":
    main()
