"""How much the doctor's runtime probe slows a small real training loop.

Trains a small MLP regressor (bf16) for a fixed number of steps with no probe and
with `mixprec.doctor.Probe(every=N)` for several N, interleaving the settings
over repeats so machine noise hits them alike, and prints the best (minimum over
repeats) step time of each and its ratio to the run without a probe. Because a
shared machine makes end-to-end ratios noisy, it also times the probe's own
callbacks directly (ms spent in `before_step`/`after_step` on sampled and on
other steps) and prints the overhead that implies for each N:
``(sampled_ms + (N - 1) * other_ms) / (N * step_ms)``. Two precision setups are
measured: ``amp_bf16`` (fp32 params, bf16 autocast, torch AdamW) and
``bf16_master`` (bf16 params, compiled mixprec AdamW with an exact master: the
probe also snapshots and compares 16-bit parameters on sampled steps, and with
``--track-masters`` reconstructs the master weights twice per sampled step).

Run: ``OMP_NUM_THREADS=1 python bench/doctor_overhead.py [--json]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from typing import Any

import torch
from torch import nn

import mixprec
from mixprec.doctor import DEFAULT_EVERY, Probe


class _TimedProbe(Probe):
    """A probe that accumulates the time spent in its own step callbacks."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.sampled_s: list[float] = []
        self.other_s: list[float] = []
        self._current = 0.0

    def before_step(self, prec: Any, optimizers: Any, step: int) -> None:
        start = time.perf_counter()
        super().before_step(prec, optimizers, step)
        self._current = time.perf_counter() - start

    def after_step(self, prec: Any, optimizers: Any, report: Any) -> None:
        start = time.perf_counter()
        super().after_step(prec, optimizers, report)
        spent = self._current + time.perf_counter() - start
        (self.sampled_s if report.step % self.every == 0 else self.other_s).append(spent)


def _model(width: int, depth: int) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.LayerNorm(width), nn.GELU()]
    layers.append(nn.Linear(width, 1))
    return nn.Sequential(*layers)


def _setup(policy: str, width: int, depth: int) -> tuple[Any, nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    prec = mixprec.Precision(policy)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = prec.prepare(_model(width, depth))
    if policy == "bf16_master":
        opt = prec.optimizer(model, lr=1e-3)  # compiled step (the first one compiles)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        prec.register(opt)
    return prec, model, opt


def _time_run(
    setup: tuple[Any, nn.Module, torch.optim.Optimizer],
    every: int | None,
    args: argparse.Namespace,
    data: list[torch.Tensor],
    probe_times: dict[str, list[float]],
) -> float:
    """Seconds per step over `args.steps` steps (after `args.warmup` untimed ones)."""
    prec, model, opt = setup
    probe = (
        _TimedProbe(every=every, model=model, track_masters=args.track_masters)
        if every is not None
        else None
    )
    if probe is not None:
        probe.attach(prec)
    x, y = data
    start = 0.0
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            start = time.perf_counter()
        with prec.autocast():
            loss = (model(x).float() - y).pow(2).mean()
        prec.backward(loss)
        prec.clip_grad_norm_(model.parameters(), 1.0)
        prec.step(opt)
        opt.zero_grad(set_to_none=True)
    elapsed = (time.perf_counter() - start) / args.steps
    if probe is not None:
        probe.detach()
        probe_times["sampled"] += probe.sampled_s[1:]  # the first includes warm-up
        probe_times["other"] += probe.other_s
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--every", type=int, nargs="+", default=[1, 5, 10, 20, 50])
    parser.add_argument(
        "--track-masters", action="store_true", help="Probe(track_masters=True) (costly)"
    )
    parser.add_argument("--policies", nargs="+", default=["amp_bf16", "bf16_master"])
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args()

    torch.manual_seed(0)
    data = [torch.randn(args.batch, args.width), torch.randn(args.batch, 1)]
    settings: list[int | None] = [None, *args.every]
    results: dict[str, Any] = {
        "threads": torch.get_num_threads(),
        "model": f"MLP {args.depth}x{args.width}, batch {args.batch}",
        "track_masters": args.track_masters,
        "default_every": DEFAULT_EVERY,
        "policies": {},
    }
    for policy in args.policies:
        times: dict[str, list[float]] = {str(s): [] for s in settings}
        probe_times: dict[str, list[float]] = {"sampled": [], "other": []}
        setup = _setup(policy, args.width, args.depth)  # one model: compile once
        for _ in range(args.repeats):
            for every in settings:  # interleaved: noise hits every setting alike
                times[str(every)].append(_time_run(setup, every, args, data, probe_times))
        base = min(times["None"])
        sampled = statistics.median(probe_times["sampled"])
        other = statistics.median(probe_times["other"]) if probe_times["other"] else 0.0
        rows = []
        for every in settings:
            best = min(times[str(every)])
            implied = (
                1.0 if every is None else 1.0 + (sampled + (every - 1) * other) / (every * base)
            )
            rows.append(
                {
                    "every": every,
                    "ms_per_step": best * 1e3,
                    "ratio": best / base,
                    "implied": implied,
                }
            )
        results["policies"][policy] = {
            "rows": rows,
            "probe_ms_sampled_step": sampled * 1e3,
            "probe_ms_other_step": other * 1e3,
        }
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"{results['model']}, {results['threads']} thread(s), best of {args.repeats} runs")
    for policy, data_ in results["policies"].items():
        print(
            f"\n{policy}: probe callbacks take {data_['probe_ms_sampled_step']:.2f} ms on a "
            f"sampled step, {data_['probe_ms_other_step']:.3f} ms on others"
        )
        print(f"  {'probe':<12} {'ms/step':>8} {'measured':>9} {'implied':>8}")
        for row in data_["rows"]:
            label = "none" if row["every"] is None else f"every={row['every']}"
            print(
                f"  {label:<12} {row['ms_per_step']:8.2f} {row['ratio']:9.3f} {row['implied']:8.3f}"
            )


if __name__ == "__main__":
    main()
