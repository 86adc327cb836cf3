"""The native kernel at a git revision against the working tree's, paired in one process.

A change to ``step_cpu.cpp`` or a format header is judged by its step time against the
kernel before it, on GPT-2 small's 148 tensors (bf16 parameters, the remainder8 master,
``--moments``, gradients of 1e-3 as in ``optim_step.py --model``). Timing the two kernels
in separate runs of ``optim_step.py`` compares runs a shared machine's load moves by
10-30%; here both optimizers live in one process and step in turn, so each pair sees the
same neighbours, and the ratio is the median of per-pair ratios.

Each side's kernel (its ``step_cpu.cpp`` and ``formats/**/*.h``, the base's read with
``git show``) is built with the flags the library is built with, into a temporary
folder; an optimizer's kernels take the library current when it is made (`StepKernel`),
so each optimizer is made while ``native.library`` returns its side's build.

    OMP_NUM_THREADS=1 python bench/native_ab.py --base HEAD~1 [--moments int4]
        [--base-moments int8] [--steps 15]

It prints each side's best step and the median of the per-pair ratios (working tree
over base) with the middle half of those ratios: a median within the noise of the
host shows as a middle half around 1. The base must hold the kernel files of today's
layout (``step_cpu.cpp`` and the format headers it includes) and build with today's
flags; an older one is refused.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

from mixprec import device_caps
from mixprec.optim import MOMENT_KINDS, AdamW, native, step_batch
from mixprec.optim.native import build
from mixprec.optim.native.binding import BuildInfo, NativeLibrary

SRC = Path(build.SOURCE).parents[3]  # the folder holding the `mixprec` package
REPO = SRC.parent


def _kernel_files() -> list[Path]:
    """The kernel's source and the headers it includes, relative to `SRC`."""
    return [p.relative_to(SRC) for p in (build.SOURCE, *build.FORMAT_HEADERS)]


def _build(rev: str | None, into: Path) -> NativeLibrary:
    """The kernel at git revision `rev` (None: the working tree), built into `into`."""
    for rel in _kernel_files():
        dst = into / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if rev is None:
            dst.write_bytes((SRC / rel).read_bytes())
        else:
            path = (SRC / rel).relative_to(REPO).as_posix()
            dst.write_bytes(
                subprocess.run(
                    ["git", "show", f"{rev}:{path}"], cwd=REPO, check=True, capture_output=True
                ).stdout
            )
    flags, compiler = build.flag_sets()[0], build._compiler()  # $CXX, as the library
    lib = into / "step_cpu.so"
    source = into / Path(build.SOURCE).relative_to(SRC)
    # the base's errors are refused in one line (main); the working tree's are shown
    subprocess.run(
        [compiler, *flags, str(source), "-o", str(lib)], check=True, capture_output=rev is not None
    )
    return NativeLibrary(BuildInfo(lib, compiler, flags, 0.0))


def _optimizer(lib: NativeLibrary, moments: str) -> AdamW:
    """AdamW over GPT-2 small's tensors whose native kernels are `lib`'s."""
    from optim_step import MODELS, _model_params  # bench/ is on sys.path when run

    step_batch._KERNELS.clear()  # kernels are shared by family: make this one's own
    with mock.patch.object(native, "library", return_value=lib):
        params = _model_params(MODELS["gpt2-small"](), torch.bfloat16)
        opt = AdamW(params, master="remainder8", moments=moments, fused=True, seed=0)
        opt.step()
    return opt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", required=True, help="git revision of the kernel to beat")
    parser.add_argument("--moments", default="int4", choices=MOMENT_KINDS, help="both sides'")
    parser.add_argument("--base-moments", choices=MOMENT_KINDS, help="the base side's, if another")
    parser.add_argument("--steps", type=int, default=15, help="timed pairs (at least 1)")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"--steps {args.steps}: time at least one pair")
    rev = subprocess.run(
        ["git", "rev-parse", "--verify", "--quiet", f"{args.base}^{{commit}}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    if rev.returncode != 0:
        parser.error(f"--base {args.base}: not a commit of {REPO}")
    with tempfile.TemporaryDirectory() as tmp:
        try:
            base_lib = _build(args.base, Path(tmp) / "base")
        except subprocess.CalledProcessError as exc:  # no such file there, or no build
            why = (exc.stderr or b"").decode(errors="replace").strip().splitlines()
            parser.error(f"--base {args.base}: {why[0] if why else exc}; give a later commit")
        try:
            work_lib = _build(None, Path(tmp) / "work")
        except subprocess.CalledProcessError:
            parser.exit(
                1, "the working tree's kernel did not build (the compiler's errors above)\n"
            )
        print(f"cpu: {device_caps('cpu').name}, torch {torch.__version__}, 1 thread, thread time")
        base = _optimizer(base_lib, args.base_moments or args.moments)
        work = _optimizer(work_lib, args.moments)
        gc.collect()
        times: dict[str, list[float]] = {"base": [], "work": []}
        for i in range(args.steps):
            order = (("base", base), ("work", work)) if i % 2 else (("work", work), ("base", base))
            for name, opt in order:
                t0 = time.thread_time()
                opt.step()
                times[name].append(time.thread_time() - t0)
    ratios = [w / b for w, b in zip(times["work"], times["base"], strict=True)]
    base_moments = args.base_moments or args.moments
    print(f"base {args.base} ({base_moments}): best {min(times['base']) * 1e3:.1f} ms")
    print(f"working tree ({args.moments}): best {min(times['work']) * 1e3:.1f} ms")
    # The middle half of the pairs' ratios: a median inside it may be the host's noise
    # (9-pair medians of 0.96 here read 0.995 over 15 pairs).
    low, high = (
        statistics.quantiles(ratios, n=4, method="inclusive")[::2]
        if len(ratios) > 1
        else (ratios[0],) * 2
    )
    pairs = "1 pair" if args.steps == 1 else f"{args.steps} pairs"
    print(
        f"working / base: {statistics.median(ratios):.3f} (median of {pairs}; "
        f"middle half {low:.3f}-{high:.3f})"
    )


if __name__ == "__main__":
    main()
