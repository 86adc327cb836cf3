"""A training step with gradient release against the same step without it, on a GPT-2 small.

The model is the workloads' `GPT` at GPT-2 small's shape (12 layers, 12 heads, width 768,
vocabulary 50257, context 1024: 124,439,808 parameters in 148 tensors, the head tied to
the token embedding), trained under a policy (default ``bf16_lean``) once with
``release_gradients=False`` and once with ``True`` (so ``--policy bf16_lean4``, which
releases, is also measured without), on one thread:

* time: the two loops in one process, their steps interleaved (the order flipping every
  step), the median of each and the ratio release / ordinary;
* peak memory: each variant in a process of its own, with glibc returning every block of
  64 KiB or more to the system when freed (``MALLOC_MMAP_THRESHOLD_``), so the resident
  set follows the live tensors. After a warm-up step (optimizer state made, gradients
  freed) the kernel's peak-RSS mark is reset (``/proc/self/clear_refs``) and one step is
  run: its peak above the resident set before it is the step's own memory (gradients,
  activations, temporaries). `mixprec.memory.measure` is not used: it counts gradients
  from its own post-accumulate hooks, which run after release has freed them.

    OMP_NUM_THREADS=1 python bench/grad_release.py [--policy bf16_lean] [--seq 128]
        [--batch 1] [--steps 4] [--layers 12] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from mixprec import Precision, preset
from mixprec.policy import preset_names
from mixprec.workloads.gpt import GPT, GPTConfig


class _Loop:
    """One training loop (model, `Precision`, optimizer), stepped a step at a time."""

    def __init__(self, args: argparse.Namespace, release: bool) -> None:
        config = GPTConfig(
            vocab_size=50257, block_size=1024, n_layer=args.layers, n_head=12, n_embd=768
        )
        torch.manual_seed(0)
        self.model = GPT(config)
        policy = preset(args.policy)
        self.prec = Precision(policy.replace(release_gradients=release))
        self.prec.prepare(self.model)
        self.opt = self.prec.optimizer(self.model, lr=1e-4)
        self.args = args

    def step(self, step: int) -> float:
        """Seconds for training step `step` (the batch is made outside the timing)."""
        gen = torch.Generator().manual_seed(step)
        shape = (self.args.batch, self.args.seq + 1)
        tokens = torch.randint(0, 50257, shape, generator=gen)
        x, y = tokens[:, :-1], tokens[:, 1:]
        start = time.perf_counter()
        with self.prec.autocast():
            logits = self.model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        self.prec.backward(loss)
        self.prec.step(self.opt)
        self.opt.zero_grad(set_to_none=True)
        return time.perf_counter() - start


def _status(key: str) -> int:
    """A ``/proc/self/status`` figure in bytes (``VmRSS``, ``VmHWM``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _memory(args: argparse.Namespace) -> dict[str, Any]:
    """This process: one variant's resident set before a step and its peak during one."""
    loop = _Loop(args, release=args.variant == "release")
    loop.step(0)  # state made, gradients freed
    before = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak-RSS mark
    loop.step(1)
    peak = _status("VmHWM")
    return {"variant": args.variant, "rss_before": before, "peak": peak, "step": peak - before}


def _measure_memory(args: argparse.Namespace, variant: str) -> dict[str, Any]:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
    command = [sys.executable, __file__, "--variant", variant, *_passed(args)]
    out = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


def _passed(args: argparse.Namespace) -> list[str]:
    return [
        f"--policy={args.policy}",
        f"--seq={args.seq}",
        f"--batch={args.batch}",
        f"--layers={args.layers}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="bf16_lean", choices=preset_names(include_auto=False))
    parser.add_argument("--seq", type=_positive, default=128)
    parser.add_argument("--batch", type=_positive, default=1)
    parser.add_argument("--layers", type=_positive, default=12)
    parser.add_argument("--steps", type=_positive, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--variant", choices=("ordinary", "release"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant is not None:  # a memory run, in its own process
        print(json.dumps(_memory(args)))
        return
    loops = {"ordinary": _Loop(args, release=False), "release": _Loop(args, release=True)}
    times: dict[str, list[float]] = {name: [] for name in loops}
    for step in range(args.warmup + args.steps):
        order = list(loops) if step % 2 == 0 else list(reversed(loops))
        for name in order:
            seconds = loops[name].step(step)
            if step >= args.warmup:
                times[name].append(seconds)
    same = all(
        torch.equal(p, q)
        for p, q in zip(
            loops["ordinary"].model.parameters(), loops["release"].model.parameters(), strict=True
        )
    )
    params = sum(p.numel() for p in loops["ordinary"].model.parameters())
    del loops
    median = {name: statistics.median(t) for name, t in times.items()}
    memory = {name: _measure_memory(args, name) for name in ("ordinary", "release")}
    record = {
        "cpu": _cpu_name(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "policy": args.policy,
        "layers": args.layers,
        "batch": args.batch,
        "seq": args.seq,
        "steps": args.steps,
        "median_s": median,
        "ratio_release": median["release"] / median["ordinary"],
        "weights_bitwise_equal": same,
        "memory": memory,
        "step_peak_saved_bytes": memory["ordinary"]["step"] - memory["release"]["step"],
        "parameters": params,
    }
    if args.json:
        print(json.dumps(record, indent=2))
        return
    cpu = _cpu_name()
    print(f"cpu: {cpu}, torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    print(
        f"GPT-2 small shape ({args.layers} layers), policy {args.policy}, "
        f"batch {args.batch} x {args.seq} tokens, {args.steps} timed steps"
    )
    print(f"{'':10} {'step s':>9} {'RSS before':>12} {'step peak':>12} {'over RSS':>12}")
    for name in ("ordinary", "release"):
        m = memory[name]
        print(
            f"{name:10} {median[name]:9.3f} {m['rss_before'] / 2**20:10.0f}Mi "
            f"{m['peak'] / 2**20:10.0f}Mi {m['step'] / 2**20:10.0f}Mi"
        )
    print(f"release / ordinary time: {record['ratio_release']:.3f}")
    print(f"weights bitwise equal after the timed steps: {same}")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return value


def _cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


if __name__ == "__main__":
    main()
