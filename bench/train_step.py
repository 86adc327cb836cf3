"""A whole training step with `prec.optimizer` against the same loop with torch's fused AdamW.

The drop-in claim on a real model: the built-in Shakespeare workload (``small``:
109k parameters in about 30 tensors) trained under a policy, once with the
optimizer `Precision.optimizer` builds and once with ``torch.optim.AdamW(fused=True)``
registered with the same `Precision`, alternating, in one run:

    OMP_NUM_THREADS=2 python bench/train_step.py [--size small] [--policy fp32] [--steps 40]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from mixprec import Precision, device_caps
from mixprec.workloads import load_workload


def _loop(size: str, policy: str, steps: int, use_mixprec: bool) -> float:
    workload = load_workload("shakespeare", size=size)
    torch.manual_seed(0)
    model = workload.make_model(0)
    prec = Precision(policy)
    prec.prepare(model)
    if use_mixprec:
        opt = prec.optimizer(model, lr=1e-3)
    else:
        opt = prec.register(torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True))
    times = []
    for step in range(steps):
        x, y = workload.train_batch(
            step=step, seed=0, batch_size=workload.defaults.batch_size, device="cpu"
        )
        start = time.perf_counter()
        with prec.autocast():
            loss = workload.loss(model(x), y)
        prec.backward(loss)
        prec.step(opt)
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times[5:]) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small")
    parser.add_argument("--policy", default="fp32")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3, help="alternating pairs of loops")
    args = parser.parse_args()
    caps = device_caps("cpu")
    print(
        f"cpu: {caps.name} ({platform.machine()}), torch {torch.__version__}, "
        f"threads {torch.get_num_threads()}, shakespeare {args.size}, policy {args.policy}"
    )
    print("round  torch fused ms/step  prec.optimizer ms/step  ratio")
    ratios = []
    for r in range(args.rounds):
        peer = _loop(args.size, args.policy, args.steps, use_mixprec=False)
        ours = _loop(args.size, args.policy, args.steps, use_mixprec=True)
        ratios.append(ours / peer)
        print(f"{r:>5}  {peer:>19.2f}  {ours:>22.2f}  {ours / peer:.3f}")
    print(f"median ratio {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
