"""Bytes per parameter and the peak memory of a training step on GPT-2 small (124M).

Each setup trains mixprec's `GPT` at GPT-2 small's shape (12 layers, 768 wide, 50257
tokens, tied head; every 2-D tensor's row a multiple of 128) for a few steps in a
process of its own, on CPU:

* ``torch`` : fp32 parameters, ``torch.optim.AdamW(fused=True)``, no autocast;
* a mixprec preset (``bf16_lean``, ``bf16_lean4``, ...): ``Precision(preset)``,
  ``prec.optimizer(model)`` (mixprec AdamW with the preset's master and moments).

Per setup it prints:

* the training state by component in bytes per parameter, measured by
  `mixprec.memory.measure` on a step after the optimizer state exists, next to
  `mixprec.memory.estimate`'s prediction (what ``mixprec budget`` prints);
* under gradient release, the largest gradient held during backward (``released_grads``);
* the peak memory of one training step: the process's resident high-water mark
  during that step (reset through ``/proc/self/clear_refs``) less its resident size
  before the model was built. glibc's mmap threshold is pinned
  (``MALLOC_MMAP_THRESHOLD_``), so freed tensors leave the resident set.

Run: ``OMP_NUM_THREADS=2 PYTHONPATH=src python bench/lean_memory.py`` (``--setups`` picks
setups, default ``torch,bf16_lean,bf16_lean4``). Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

COMPONENTS = ("params", "grads", "master", "moments")
#: Held during backward only (under gradient release: the largest gradient).
TRANSIENT = "released_grads"
MiB = 2**20


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def one(setup: str, batch: int, seq: int) -> dict[str, Any]:
    """Train `setup` for a few steps here; its figures."""
    import torch
    import torch.nn.functional as F

    from mixprec import Precision
    from mixprec.memory import estimate, measure
    from mixprec.workloads.gpt import GPT, GPTConfig

    base = _rss()
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)
    dtype = torch.float32
    prec = None
    if setup != "torch":
        prec = Precision(setup)
        dtype = prec.policy.param_dtype
    torch.set_default_dtype(dtype)  # built in its own dtype: no fp32 copy on the way
    model = GPT(config)
    torch.set_default_dtype(torch.float32)
    if prec is not None:
        model = prec.prepare(model)
        opt = prec.optimizer(model, lr=1e-4)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x = torch.randint(0, config.vocab_size, (batch, seq + 1))

    def step() -> None:
        if prec is not None:
            with prec.autocast():
                logits = model(x[:, :-1])
            loss = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
            prec.backward(loss)
            prec.step(opt)
        else:
            loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
            loss.backward()
            opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):  # the optimizer state exists from the first step
        step()
    _reset_hwm()
    t0 = time.perf_counter()
    step()
    seconds = time.perf_counter() - t0
    peak = _hwm() - base
    policy = prec.policy if prec is not None else "fp32"
    got = measure(model, opt, step, policy=policy)
    want = estimate(model, policy)
    n = got.params
    return {
        "setup": setup,
        "params": n,
        "measured": {c: getattr(got.bytes, c) / n for c in COMPONENTS},
        "predicted": {c: getattr(want.bytes, c) / n for c in COMPONENTS},
        "released": (got.bytes.released_grads / MiB, want.bytes.released_grads / MiB),
        "peak_mib": peak / MiB,
        "step_s": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setups", default="torch,bf16_lean,bf16_lean4")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.batch, args.seq)))
        return
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
    rows = []
    for setup in args.setups.split(","):
        cmd = [sys.executable, __file__, "--one", setup, "--batch", str(args.batch)]
        out = subprocess.run(
            [*cmd, "--seq", str(args.seq)], env=env, capture_output=True, text=True, check=False
        )
        if out.returncode:
            print(f"{setup}: failed\n{out.stderr[-2000:]}", file=sys.stderr)
            continue
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    torch_peak = next((r["peak_mib"] for r in rows if r["setup"] == "torch"), None)
    print(f"# GPT-2 small on CPU, batch {args.batch} x {args.seq} tokens")
    header = " | ".join(COMPONENTS)
    print(f"| setup | {header} | total B/param | released MiB | step peak MiB | vs torch |")
    print("|---|" + "---|" * (len(COMPONENTS) + 4))
    for r in rows:
        cells = [
            f"{r['measured'][c]:.3f} ({r['predicted'][c]:.3f})"
            if abs(r["measured"][c] - r["predicted"][c]) > 5e-4
            else f"{r['measured'][c]:.3f}"
            for c in COMPONENTS
        ]
        total = sum(r["measured"].values())
        ratio = f"{r['peak_mib'] / torch_peak:.2f}" if torch_peak else "-"
        got, want = r["released"]
        released = f"{got:.1f}" if got == want else f"{got:.1f} ({want:.1f})"
        print(
            f"| {r['setup']} | " + " | ".join(cells) + f" | {total:.3f} | {released} | "
            f"{r['peak_mib']:.0f} | {ratio} |"
        )
    print("(a component shows the prediction in parentheses where it differs; released: the")
    print(" most gradient bytes held at once during backward under gradient release)")


if __name__ == "__main__":
    main()
