"""Optimizer step benchmark: mixprec AdamW formats against torch, torchao and optimi.

Run with OMP_NUM_THREADS=2, e.g. ``python bench/optim_step.py --sizes 16M,64M``.

One parameter of N elements, bf16 unless said otherwise. Each row is measured
paired with the reference (``torch.optim.AdamW(fused=True)``, fp32 params):
the two steps alternate ``--steps`` times and the ratio is best over best of
the same window, so a neighbour's load shifts both. Columns:

* ms best / median of the steps after the first;
* ratio: best ms over the reference's best ms in the same window;
* bytes/param: persistent params + grads + optimizer state (`training_state_bytes`);
* GB/s: ``2 * (params + state) + grads`` bytes per step (every persistent byte
  read and written once, the gradient read) over the best ms, and that as a
  fraction of an in-place elementwise pass (``x.mul_(1.0)`` on fp32, 8 bytes
  per element) measured at the same size in the same run, paired with the
  reference in the same way;
* first s: the first step (for compiled rows, compilation; Inductor's on-disk
  cache makes a second run much faster).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mixprec.optim import MASTER_KINDS, MOMENT_KINDS, AdamW, training_state_bytes

Factory = Callable[[torch.Tensor], torch.optim.Optimizer]


@dataclass(frozen=True)
class Row:
    """One measured optimizer."""

    name: str
    best_ms: float
    median_ms: float
    ratio: float
    bytes_per_param: float
    gbs: float
    bandwidth_fraction: float
    first_s: float


def _size(text: str) -> int:
    return int(float(text.rstrip("M")) * 2**20) if text.endswith("M") else int(text)


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _inplace_bandwidth(n: int, ref: Callable[[], object], steps: int) -> float:
    """Bytes per second of ``x.mul_(1.0)`` on fp32 (read + write), paired with `ref`."""
    x = torch.randn(n)
    x.mul_(1.0)
    best = float("inf")
    for _ in range(2 * steps):
        ref()
        best = min(best, _timed(lambda: x.mul_(1.0)))
    return 8 * n / best


def _param(n: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(n, generator=gen).to(dtype).requires_grad_()
    p.grad = torch.randn(n, generator=gen).to(dtype)
    return p


def _moved_bytes(opt: torch.optim.Optimizer) -> int:
    b = training_state_bytes(opt)
    return 2 * (b["total"] - b["grads"]) + b["grads"]


def measure(
    name: str, factory: Factory, dtype: torch.dtype, n: int, ref: Callable[[], object], **kw: int
) -> Row:
    """Build `factory`'s optimizer on one parameter and time it paired with `ref`."""
    steps, bandwidth = kw["steps"], kw["bandwidth"] / 1e9
    opt = factory(_param(n, dtype))
    first = _timed(opt.step)
    ours, theirs = [], []
    for _ in range(steps):
        theirs.append(_timed(ref))
        ours.append(_timed(opt.step))
    best = min(ours)
    gbs = _moved_bytes(opt) / best / 1e9
    row = Row(
        name=name,
        best_ms=best * 1e3,
        median_ms=statistics.median(ours) * 1e3,
        ratio=best / min(theirs),
        bytes_per_param=training_state_bytes(opt)["total"] / n,
        gbs=gbs,
        bandwidth_fraction=gbs / bandwidth,
        first_s=first,
    )
    del opt
    gc.collect()
    return row


def _mixprec(master: str, moments: str) -> Factory:
    return lambda p: AdamW([p], master=master, moments=moments, fused=True, seed=0)


def _peers() -> list[tuple[str, Factory, torch.dtype]]:
    """Peer optimizers that import here; the others are printed as skipped."""
    peers: list[tuple[str, Factory, torch.dtype]] = []
    try:
        from torchao.optim import AdamW8bit, _AdamW

        peers.append(
            (
                "torchao _AdamW bf16 SR",
                lambda p: _AdamW([p], bf16_stochastic_round=True),
                torch.bfloat16,
            )
        )
        peers.append(
            (
                "torchao AdamW8bit bf16 SR",
                lambda p: AdamW8bit([p], bf16_stochastic_round=True),
                torch.bfloat16,
            )
        )
    except ImportError as exc:
        print(f"skipped torchao: {exc}")
    try:
        from optimi import AdamW as OptimiAdamW

        peers.append(
            (
                "optimi AdamW kahan_sum",
                lambda p: OptimiAdamW([p], lr=1e-3, kahan_sum=True, foreach=True),
                torch.bfloat16,
            )
        )
    except ImportError as exc:
        print(f"skipped optimi: {exc}")
    return peers


def _print_row(row: Row) -> None:
    cells = [
        row.name,
        f"{row.best_ms:.1f} / {row.median_ms:.1f}",
        f"{row.ratio:.2f}",
        f"{row.bytes_per_param:.2f}",
        f"{row.gbs:.1f} ({row.bandwidth_fraction:.0%})",
        f"{row.first_s:.1f}",
    ]
    print("| " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="16M,64M")
    parser.add_argument("--steps", type=int, default=7, help="paired timed steps per row")
    parser.add_argument(
        "--combos",
        default="all",
        help="comma-separated master+moments (e.g. exact+fp32), or 'all'",
    )
    parser.add_argument("--no-peers", action="store_true", help="skip torchao and optimi rows")
    args = parser.parse_args()
    if args.combos == "all":
        combos = [(m, mo) for m in MASTER_KINDS for mo in MOMENT_KINDS]
    else:
        combos = [(c.split("+")[0], c.split("+")[1]) for c in args.combos.split(",")]
    peers = [] if args.no_peers else _peers()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for n in (_size(s) for s in args.sizes.split(",")):
        ref_opt = torch.optim.AdamW([_param(n, torch.float32)], fused=True)
        ref_opt.step()
        bandwidth = _inplace_bandwidth(n, ref_opt.step, args.steps)
        print(f"\n## {n / 2**20:g}M params; in-place elementwise pass {bandwidth / 1e9:.1f} GB/s\n")
        print(
            "| optimizer | ms best / median | ratio | bytes/param | GB/s (of in-place) | first s |"
        )
        print("| --- | --- | --- | --- | --- | --- |")
        kw = {"steps": args.steps, "bandwidth": int(bandwidth)}
        ref_row = measure(
            "torch AdamW fused (fp32)",
            lambda p: torch.optim.AdamW([p], fused=True),
            torch.float32,
            n,
            ref_opt.step,
            **kw,
        )
        _print_row(ref_row)
        for master, moments in combos:
            name = f"mixprec {master}+{moments}"
            _print_row(
                measure(name, _mixprec(master, moments), torch.bfloat16, n, ref_opt.step, **kw)
            )
        for name, factory, dtype in peers:
            try:
                _print_row(measure(name, factory, dtype, n, ref_opt.step, **kw))
            except Exception as exc:  # a peer that does not run on this device
                print(f"| {name} | skipped: {type(exc).__name__}: {str(exc)[:80]} | | | | |")
        del ref_opt
        gc.collect()


if __name__ == "__main__":
    main()
