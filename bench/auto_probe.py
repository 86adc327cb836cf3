"""What a measured ``auto`` picks here: step times per compute format, their ratios, the choice.

Runs `mixprec.speed.measure_speed` (cache off) on a built-in workload's model and
on matmul shapes, and prints each format's best and median step time, its ratio
to fp32's and the preset ``auto`` picks. With ``--full-steps N`` it also times N
whole training steps of the workload (autocast forward, backward, `Precision.step`
with mixprec's AdamW) under ``fp32`` and ``amp_bf16``, interleaved, to check the
probe's forward+backward ratio against a real step's:

    OMP_NUM_THREADS=2 python bench/auto_probe.py --workload shakespeare --size small \
        --shape 4096x4096x4096 --repeats 7 --full-steps 30
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import mixprec
from mixprec.speed import SpeedMeasurement, measure_speed
from mixprec.workloads import load_workload


def _print(measured: SpeedMeasurement) -> None:
    best, median = measured.times(), measured.medians()
    ratio, median_ratio = measured.ratios(), measured.median_ratios()
    print(f"\n{measured.target} on {measured.device} ({measured.threads} thread(s))")
    print(f"  {'format':6}  {'best ms':>9}  {'median ms':>9}  {'x fp32':>7}  {'median x':>8}")
    for name in best:
        print(
            f"  {name:6}  {best[name] * 1e3:9.1f}  {median[name] * 1e3:9.1f}  "
            f"{ratio[name]:6.2f}x  {median_ratio[name]:7.2f}x"
        )
    for name, why in measured.skipped.items():
        print(f"  {name:6}  not measured: {why}")
    auto = mixprec.policy.resolve_auto(measured=measured)
    print(f"  auto -> {auto.name}")


def _full_steps(workload_name: str, size: str, steps: int) -> None:
    """Whole training steps under fp32 and amp_bf16, alternating, the order flipping."""
    workload = load_workload(workload_name, size=size)
    loops = {}
    for name in ("fp32", "amp_bf16"):
        model = workload.make_model(0)
        prec = mixprec.Precision(name)
        prec.prepare(model)
        loops[name] = (model, prec, prec.optimizer(model, lr=1e-3))
    times: dict[str, list[float]] = {name: [] for name in loops}
    batch = workload.defaults.batch_size
    for step in range(steps + 3):
        order = list(loops) if step % 2 == 0 else list(reversed(loops))
        x, y = workload.train_batch(step=step, seed=0, batch_size=batch, device="cpu")
        for name in order:
            model, prec, opt = loops[name]
            start = time.perf_counter()
            with prec.autocast():
                loss = workload.loss(model(x), y)
            prec.backward(loss)
            prec.step(opt)
            opt.zero_grad(set_to_none=True)
            if step >= 3:  # warm-up
                times[name].append(time.perf_counter() - start)
    base = min(times["fp32"])
    print(f"\nwhole training steps of {workload_name} {size} ({steps} each, interleaved)")
    for name, values in times.items():
        print(
            f"  {name:8}  best {min(values) * 1e3:7.1f} ms  median "
            f"{statistics.median(values) * 1e3:7.1f} ms  {min(values) / base:5.2f}x"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="shakespeare")
    parser.add_argument("--size", default="small")
    parser.add_argument("--shape", action="append", default=[], help="MxNxK[,...]; repeatable")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--formats", default=None, help="e.g. fp32,bf16,fp16 (default: auto's)")
    parser.add_argument("--full-steps", type=int, default=0)
    args = parser.parse_args()
    caps = mixprec.device_caps("cpu")
    print(f"CPU: {caps.name}; {caps.bf16_reason}; {caps.fp16_reason}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    formats = None if args.formats is None else args.formats.split(",")
    workload = load_workload(args.workload, size=args.size)
    model = workload.make_model(0)
    x, y = workload.train_batch(
        step=0, seed=0, batch_size=workload.defaults.batch_size, device="cpu"
    )
    _print(
        measure_speed(
            model,
            x,
            loss_fn=lambda out: workload.loss(out, y),
            formats=formats,
            repeats=args.repeats,
            label=f"{args.workload} {args.size}",
            cache="off",
        )
    )
    for shape in args.shape:
        _print(measure_speed(shapes=shape, formats=formats, repeats=args.repeats, cache="off"))
    if args.full_steps:
        _full_steps(args.workload, args.size, args.full_steps)


if __name__ == "__main__":
    main()
