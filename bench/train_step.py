"""A whole training step with `prec.optimizer` against the same loop with torch's fused AdamW.

The drop-in claim on a real model: the built-in Shakespeare workload (``small``:
109k parameters in about 30 tensors) trained under a policy, once with the
optimizer `Precision.optimizer` builds and once with ``torch.optim.AdamW(fused=True)``
registered with the same `Precision`, interleaved step by step in one run (the
two loops' steps alternate, the order flipping every step):

    OMP_NUM_THREADS=2 python bench/train_step.py [--size small] [--policy fp32] [--steps 200]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from mixprec import Precision, device_caps
from mixprec.workloads import load_workload


class _Loop:
    """One training loop: model, `Precision` and optimizer, stepped one step at a time."""

    def __init__(self, size: str, policy: str, use_mixprec: bool) -> None:
        self.workload = load_workload("shakespeare", size=size)
        torch.manual_seed(0)
        self.model = self.workload.make_model(0)
        self.prec = Precision(policy)
        self.prec.prepare(self.model)
        if use_mixprec:
            self.opt = self.prec.optimizer(self.model, lr=1e-3)
        else:
            params = self.model.parameters()
            self.opt = self.prec.register(torch.optim.AdamW(params, lr=1e-3, fused=True))
        self.batch_size = self.workload.defaults.batch_size

    def step(self, step: int) -> float:
        """Seconds for training step `step` (the batch is made outside the timing)."""
        x, y = self.workload.train_batch(
            step=step, seed=0, batch_size=self.batch_size, device="cpu"
        )
        start = time.perf_counter()
        with self.prec.autocast():
            loss = self.workload.loss(self.model(x), y)
        self.prec.backward(loss)
        self.prec.step(self.opt)
        self.opt.zero_grad(set_to_none=True)
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small")
    parser.add_argument("--policy", default="fp32")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=10)
    args = parser.parse_args()
    caps = device_caps("cpu")
    print(
        f"cpu: {caps.name} ({platform.machine()}), torch {torch.__version__}, "
        f"threads {torch.get_num_threads()}, shakespeare {args.size}, policy {args.policy}"
    )
    peer = _Loop(args.size, args.policy, use_mixprec=False)
    ours = _Loop(args.size, args.policy, use_mixprec=True)
    peer_t, ours_t = [], []
    for step in range(args.warmup + args.steps):
        # Alternate step by step (the order flips every step), so both loops see the
        # same neighbours' load and the same thermal state.
        first, second = (peer, ours) if step % 2 else (ours, peer)
        a, b = first.step(step), second.step(step)
        if step >= args.warmup:
            (peer_t if first is peer else ours_t).append(a)
            (ours_t if first is peer else peer_t).append(b)
    ratios = [o / p for o, p in zip(ours_t, peer_t, strict=True)]
    p_ms, o_ms = statistics.median(peer_t) * 1e3, statistics.median(ours_t) * 1e3
    print(f"steps {args.steps} (after {args.warmup} warm-up), interleaved")
    print(f"torch fused ms/step (median)     {p_ms:.3f}")
    print(f"prec.optimizer ms/step (median)  {o_ms:.3f}")
    print(
        f"ratio of medians {o_ms / p_ms:.3f}; median of paired ratios "
        f"{statistics.median(ratios):.3f}"
    )


if __name__ == "__main__":
    main()
