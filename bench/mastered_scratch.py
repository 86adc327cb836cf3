"""`mixprec.optim.Mastered` on GPT-2 small's 148 tensors: its fp32 scratch against its budget,
and its step time against the bare inner optimizer on fp32 parameters, in the same run.

    OMP_NUM_THREADS=1 python bench/mastered_scratch.py [--steps 5] [--budgets 256M,64M,none]
        [--codecs auto,eager,compiled]

Memory, measured, not claimed, on a step after the first (the inner state exists):

* scratch: for each inner step (one per chunk), the bytes the stepped shadows and
  their gradients point at (a step pre-hook on the inner optimizer; the chunks take
  turns in one buffer, as large as the largest); the peak over the chunks, against
  ``scratch_bytes``, and the peak over the chunks of more than one parameter (a
  parameter over the budget is a chunk of its own, so the peak is at least
  ``8 * largest parameter``);
* transient: the peak of every CPU allocation made during one step above what was
  live when it began (``torch.profiler`` with ``profile_memory``: allocator events),
  for the wrapper and for the bare inner optimizer (its own temporaries).

The ``codec`` column is what ran (`Mastered.codec_of`): ``native`` (``codec="auto"`` on
the CPU), ``eager`` or ``compiled`` (the first step, untimed, compiles).
Time: bf16 parameters with bf16 gradients and an ``exact`` master under ``Mastered``,
against the same torch optimizer on fp32 copies with fp32 gradients; the two steps
alternate ``--steps`` times after one warm-up each, and the ratio is the median of the
per-pair ratios.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from mixprec.optim import Mastered
from optim_step import gpt2_small_shapes  # bench/ is the script's directory

MiB = 2**20
INNER: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "AdamW foreach": (torch.optim.AdamW, {"lr": 1e-3, "foreach": True}),
    "SGD momentum foreach": (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9, "foreach": True}),
}


def _params(dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for shape in gpt2_small_shapes():
        p = (torch.randn(shape, generator=gen) * 0.02).to(dtype).requires_grad_()
        p.grad = (torch.randn(shape, generator=gen) * 1e-3).to(dtype)
        out.append(p)
    return out


def chunk_scratch(opt: Mastered) -> list[tuple[int, int]]:
    """Filled, one entry per inner step, with the bytes the stepped shadows point at
    outside the parameters' and gradients' own memory, and the number stepped."""
    params = [p for g in opt.param_groups for p in g["params"]]
    owned = {t.untyped_storage().data_ptr() for p in params for t in (p, p.grad) if t is not None}
    sizes: list[tuple[int, int]] = []

    def measure(inner: torch.optim.Optimizer, *_: object) -> None:
        seen: dict[int, int] = {}
        stepped = [s for g in inner.param_groups for s in g["params"] if s.grad is not None]
        for s in stepped:
            for t in (s, s.grad):
                if t.untyped_storage().data_ptr() not in owned:
                    seen[t.data_ptr()] = t.nbytes
        sizes.append((sum(seen.values()), len(stepped)))

    opt.inner.register_step_pre_hook(measure)
    return sizes


def transient_peak(step: Callable[[], object]) -> int:
    """Peak bytes allocated during `step` above what was live when it began (the
    allocator's events, in time order; frees of older blocks count too)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    kineto = prof.profiler.kineto_results  # type: ignore[union-attr]
    events = sorted((e.start_ns(), e.nbytes()) for e in kineto.events() if e.name() == "[memory]")
    live = peak = 0
    for _, delta in events:
        live += delta
        peak = max(peak, live)
    return peak


def _paired(
    ours: Callable[[], object], ref: Callable[[], object], steps: int
) -> tuple[float, float, float]:
    ours()
    ref()
    t_ours, t_ref = [], []
    for _ in range(steps):
        for fn, times in ((ref, t_ref), (ours, t_ours)):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    ratios = [a / b for a, b in zip(t_ours, t_ref, strict=True)]
    return statistics.median(t_ours), statistics.median(t_ref), statistics.median(ratios)


def _budget(text: str) -> int | None:
    text = text.strip().lower()
    if text == "none":
        return None
    scale = {"k": 2**10, "m": MiB, "g": 2**30}.get(text[-1], 1)
    return int(float(text.rstrip("kmg")) * scale)


def _cpu() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--budgets", default="256M,64M,none")
    parser.add_argument("--codecs", default="auto,eager,compiled")
    args = parser.parse_args()
    budgets = [_budget(b) for b in args.budgets.split(",")]
    codecs = args.codecs.split(",")
    shapes = gpt2_small_shapes()
    numel = sum(torch.Size(s).numel() for s in shapes)
    largest = max(torch.Size(s).numel() for s in shapes)
    print(f"# Mastered on GPT-2 small: {len(shapes)} tensors, {numel:,} parameters")
    print(f"CPU: {_cpu()}; torch {torch.__version__}; threads {torch.get_num_threads()}")
    print(f"largest parameter: {largest:,} elements ({8 * largest / MiB:.1f} MiB of scratch)\n")
    print(
        "| inner | scratch_bytes | codec | chunks | peak scratch MiB | peak / budget | peak "
        "MiB, chunks of several | transient MiB (wrapper) | transient MiB (bare) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    # The memory rows: every budget with the first codec, the first budget with the others.
    combos = [(b, codecs[0]) for b in budgets] + [(budgets[0], c) for c in codecs[1:]]
    for name, (cls, kwargs) in INNER.items():
        ref_params = _params(torch.float32)
        ref = cls(ref_params, **kwargs)
        ref.step()
        bare = transient_peak(ref.step)
        del ref, ref_params
        for budget, codec in combos:
            params = _params(torch.bfloat16)
            opt = Mastered(cls, params, scratch_bytes=budget, codec=codec, **kwargs)
            opt.step()  # the inner state is made (and the codec compiled)
            sizes = chunk_scratch(opt)
            wrapper = transient_peak(opt.step)
            peak = max(b for b, _ in sizes)
            several = max((b for b, n in sizes if n > 1), default=0)
            shown = "none" if budget is None else f"{budget / MiB:.0f} MiB"
            ratio = "-" if budget is None else f"{peak / budget:.2f}"
            how = opt.codec_of(params[0])
            print(
                f"| {name} | {shown} | {how} | {len(sizes)} | {peak / MiB:.1f} | "
                f"{ratio} | {several / MiB:.1f} | {wrapper / MiB:.1f} | {bare / MiB:.1f} |",
                flush=True,
            )
            del opt, params
    print("\n| inner | scratch_bytes | codec | Mastered ms | bare fp32 ms | ratio |")
    print("| --- | --- | --- | --- | --- | --- |")
    timed = [(budgets[0], c) for c in codecs] + [(None, codecs[0])] * (None in budgets)
    for name, (cls, kwargs) in INNER.items():
        for budget, codec in timed:
            params = _params(torch.bfloat16)
            ref_params = _params(torch.float32)
            opt = Mastered(cls, params, scratch_bytes=budget, codec=codec, **kwargs)
            ref = cls(ref_params, **kwargs)
            ours_s, ref_s, ratio = _paired(opt.step, ref.step, args.steps)
            shown = "none" if budget is None else f"{budget / MiB:.0f} MiB"
            print(
                f"| {name} | {shown} | {opt.codec_of(params[0])} | {ours_s * 1e3:.0f} | "
                f"{ref_s * 1e3:.0f} | {ratio:.2f} |",
                flush=True,
            )
            del opt, ref, params, ref_params


if __name__ == "__main__":
    main()
