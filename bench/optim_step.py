"""Optimizer step benchmark: mixprec AdamW formats against torch, torchao and optimi.

Run with OMP_NUM_THREADS=2, e.g. ``python bench/optim_step.py --sizes 16M,64M``, or
on a real model's parameter tensors with ``--model gpt2-small`` (148 tensors, 124M
parameters) or ``--model shakespeare-small`` (the built-in workload's model).

``--model``: every tensor of the model, bf16 for the mixprec rows (fp32 for
``none`` and for the reference), one param group, against
``torch.optim.AdamW(fused=True)`` on fp32 copies; the ratio is the median of
per-pair ratios, the two optimizers alternating step by step.
Each row also gives the same optimizer on one tensor of the model's size
(``1-tensor ratio``), so the cost of many tensors shows as the difference: a matrix
as wide as the model's largest tensor (``(numel // 768, 768)`` for GPT-2 small, so
int4 moments take it as they take the model's matrices), or flat if it does not
divide.

One parameter of N elements, bf16 unless said otherwise. Each row is measured
paired with the reference (``torch.optim.AdamW(fused=True)``, fp32 params):
the two steps alternate ``--steps`` times and the ratio is best over best of
the same window, so a neighbour's load shifts both. Columns:

* ms best / median of the steps after the first;
* ratio: best ms over the reference's best ms in the same window;
* bytes/param: persistent params + grads + optimizer state
  (`mixprec.memory.training_state_bytes`);
* GB/s: ``2 * (params + state) + grads`` bytes per step (every persistent byte
  read and written once, the gradient read) over the best ms, and that as a
  fraction of an in-place elementwise pass (``x.mul_(1.0)`` on fp32, 8 bytes
  per element) at the same size, timed in the same window as the row (the
  reference, the pass and the row's step alternate);
* first s: the first step (for the first native row it includes building
  the native kernel unless it is cached; for ``(inductor)`` rows, compilation;
  Inductor's on-disk cache makes a second run much faster).

``mixprec`` rows use ``fused=True``: on CPU the native kernel
(`mixprec.optim.native`). ``--inductor`` adds the same combinations stepped
through ``torch.compile`` (``MIXPREC_NATIVE=0``) for comparison.

``--clock thread`` (with ``OMP_NUM_THREADS=1``) times each step in the thread's CPU
time instead of wall time: on a machine shared with other work, a step the scheduler
pauses is not charged for the pause.

``--rule adamw,lion`` (or ``all``): each update rule's native step on one tensor of
each ``--sizes`` and on GPT-2 small's tensors, fp32 params without a master and bf16
params with the exact master, fp32 moments, against the fastest torch
implementation of the same optimizer on fp32 params: ``fused=True`` AdamW, Adam
and SGD, and for Lion a ``torch._foreach_*`` version of lion-pytorch's update
(`ForeachLion`). Ratio: the median of paired per-step ratios (`_paired`).
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mixprec import device_caps
from mixprec.memory import training_state_bytes
from mixprec.optim import MASTER_KINDS, MOMENT_KINDS, SGD, Adam, AdamW, Lion, native
from mixprec.optim.rules import RULES

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


#: What `_timed` reads: wall time, or with ``--clock thread`` this thread's CPU time
#: (``time.thread_time``), which leaves out the time a busy machine's other processes
#: hold the core (one thread only: both kernels then run on the calling thread).
_clock: Callable[[], float] = time.perf_counter


def _timed(fn: Callable[[], object]) -> float:
    t0 = _clock()
    fn()
    return _clock() - t0


class InPlacePass:
    """An in-place fp32 ``x.mul_(1.0)`` over N elements: 8 bytes moved per element."""

    def __init__(self, n: int) -> None:
        self.x = torch.randn(n)
        self.x.mul_(1.0)

    def __call__(self) -> None:
        self.x.mul_(1.0)

    def bandwidth(self, seconds: float) -> float:
        """Bytes per second of one pass that took `seconds`."""
        return 8 * self.x.numel() / seconds


def _param(n: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(n, generator=gen).to(dtype).requires_grad_()
    p.grad = torch.randn(n, generator=gen).to(dtype)
    return p


def _moved_bytes(opt: torch.optim.Optimizer) -> int:
    b = training_state_bytes(opt)
    return 2 * (b["total"] - b["grads"]) + b["grads"]


def measure(
    name: str,
    factory: Factory,
    dtype: torch.dtype,
    n: int,
    ref: Callable[[], object],
    inplace: InPlacePass,
    steps: int,
) -> Row:
    """Build `factory`'s optimizer on one parameter and time it paired with `ref`.

    The reference step, the in-place pass and our step alternate `steps` times,
    so all three see the same neighbours' load; each is taken at its best.
    """
    opt = factory(_param(n, dtype))
    first = _timed(opt.step)
    ours, theirs, passes = [], [], []
    for _ in range(steps):
        theirs.append(_timed(ref))
        passes.append(_timed(inplace))
        ours.append(_timed(opt.step))
    best = min(ours)
    gbs = _moved_bytes(opt) / best
    row = Row(
        name=name,
        best_ms=best * 1e3,
        median_ms=statistics.median(ours) * 1e3,
        ratio=best / min(theirs),
        bytes_per_param=training_state_bytes(opt)["total"] / n,
        gbs=gbs / 1e9,
        bandwidth_fraction=gbs / inplace.bandwidth(min(passes)),
        first_s=first,
    )
    del opt
    gc.collect()
    return row


def _torch_adamw(flag: str) -> Factory:
    if flag == "fused":
        return lambda p: torch.optim.AdamW([p], fused=True)
    return lambda p: torch.optim.AdamW([p], foreach=True)


def _mixprec(master: str, moments: str, *, inductor: bool = False) -> Factory:
    def build(p: torch.Tensor) -> torch.optim.Optimizer:
        # The kernel is chosen when the param group is added: set the switch around it.
        before = os.environ.get("MIXPREC_NATIVE")
        os.environ["MIXPREC_NATIVE"] = "0" if inductor else "1"
        try:
            return AdamW([p], master=master, moments=moments, fused=True, seed=0)
        finally:
            if before is None:
                del os.environ["MIXPREC_NATIVE"]
            else:
                os.environ["MIXPREC_NATIVE"] = before

    return build


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


def gpt2_small_shapes() -> list[tuple[int, ...]]:
    """GPT-2 small's 148 parameter tensors (124,439,808 elements; Hugging Face order)."""
    d, vocab, ctx, layers = 768, 50257, 1024, 12
    block = [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,)]
    block += [(d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    return [(vocab, d), (ctx, d), *block * layers, (d,), (d,)]


def shakespeare_small_shapes() -> list[tuple[int, ...]]:
    """The tensors of the built-in ``shakespeare`` workload's ``small`` model."""
    from mixprec.workloads import load_workload

    model = load_workload("shakespeare", size="small").make_model(0)
    return [tuple(p.shape) for p in model.parameters()]


MODELS: dict[str, Callable[[], list[tuple[int, ...]]]] = {
    "gpt2-small": gpt2_small_shapes,
    "shakespeare-small": shakespeare_small_shapes,
}


def _model_params(shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    params = []
    for shape in shapes:
        p = (torch.randn(shape, generator=gen) * 0.02).to(dtype).requires_grad_()
        p.grad = (torch.randn(shape, generator=gen) * 1e-3).to(dtype)
        params.append(p)
    return params


def _paired(ours: Callable[[], object], ref: Callable[[], object], steps: int) -> float:
    """The median over `steps` pairs of ours / reference, the two alternating step by
    step with the order flipping each pair (robust to a shared machine's load swings,
    which move best-of-N figures by 30% here)."""
    ours()
    ref()
    ratios = []
    for i in range(steps):
        if i % 2:
            theirs, mine = _timed(ref), _timed(ours)
        else:
            mine, theirs = _timed(ours), _timed(ref)
        ratios.append(mine / theirs)
    return statistics.median(ratios)


def run_model(name: str, combos: list[tuple[str, str]], steps: int) -> None:
    """The `--model` table: each combination on the model's tensors and on one tensor."""
    shapes = MODELS[name]()
    numel = sum(math.prod(s) for s in shapes)
    print(f"\n## {name}: {len(shapes)} tensors, {numel:,} parameters ({_clock.__name__})\n")
    print("| optimizer | ms best | ratio | 1-tensor ratio |")
    print("| --- | --- | --- | --- |")
    # One tensor of the model's size: a matrix as wide as the model's largest tensor
    # (int4 moments need a matrix), else flat.
    width = max(shapes, key=math.prod)[-1]
    one = (numel // width, width) if numel % width == 0 else (numel,)
    ref_model = torch.optim.AdamW(_model_params(shapes, torch.float32), fused=True)
    ref_flat = torch.optim.AdamW(_model_params([one], torch.float32), fused=True)
    ref_model.step()
    best_ref = min(_timed(ref_model.step) for _ in range(steps))
    print(f"| torch AdamW fused (fp32) | {best_ref * 1e3:.2f} | 1.00 | 1.00 |", flush=True)
    for master, moments in combos:
        dtype = torch.float32 if master == "none" else torch.bfloat16
        model_params = _model_params(shapes, dtype)
        opt = AdamW(model_params, master=master, moments=moments, fused=True, seed=0)
        opt.step()
        best = min(_timed(opt.step) for _ in range(2))
        ratio = _paired(opt.step, ref_model.step, steps)
        del opt, model_params
        gc.collect()
        flat = AdamW(
            _model_params([one], dtype), master=master, moments=moments, fused=True, seed=0
        )
        flat_ratio = _paired(flat.step, ref_flat.step, steps)
        del flat
        gc.collect()
        print(
            f"| mixprec {master}+{moments} | {best * 1e3:.2f} | {ratio:.2f} | {flat_ratio:.2f} |",
            flush=True,
        )


class ForeachLion(torch.optim.Optimizer):
    """Lion as lion-pytorch's ``update_fn`` (decay, ``lerp`` to beta1 and ``sign``, step,
    ``lerp`` to beta2) with ``torch._foreach_*`` over the group: the peer a user of
    Lion on CPU has (torch has no Lion)."""

    def __init__(
        self, params: Any, lr: float, betas: tuple[float, float], weight_decay: float
    ) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            grads = [p.grad for p in params]
            exp_avgs = [self.state[p].setdefault("exp_avg", torch.zeros_like(p)) for p in params]
            lr, (beta1, beta2), wd = group["lr"], group["betas"], group["weight_decay"]
            torch._foreach_mul_(params, 1.0 - lr * wd)
            updates = torch._foreach_lerp(exp_avgs, grads, 1.0 - beta1)
            torch._foreach_sign_(updates)
            torch._foreach_add_(params, updates, alpha=-lr)
            torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta2)


#: Per rule: (mixprec optimizer, its peer on fp32 params), with the same hyperparameters.
RULE_PAIRS: dict[str, tuple[Callable[..., torch.optim.Optimizer], Factory]] = {
    "adamw": (
        lambda ps, **kw: AdamW(ps, weight_decay=0.01, **kw),
        lambda ps: torch.optim.AdamW(ps, weight_decay=0.01, fused=True),
    ),
    "adamw_amsgrad": (
        lambda ps, **kw: AdamW(ps, weight_decay=0.01, amsgrad=True, **kw),
        lambda ps: torch.optim.AdamW(ps, weight_decay=0.01, amsgrad=True, fused=True),
    ),
    "adam": (
        lambda ps, **kw: Adam(ps, weight_decay=0.01, **kw),
        lambda ps: torch.optim.Adam(ps, weight_decay=0.01, fused=True),
    ),
    "adam_amsgrad": (
        lambda ps, **kw: Adam(ps, weight_decay=0.01, amsgrad=True, **kw),
        lambda ps: torch.optim.Adam(ps, weight_decay=0.01, amsgrad=True, fused=True),
    ),
    "sgd": (
        lambda ps, **kw: SGD(ps, lr=0.1, weight_decay=0.01, **kw),
        lambda ps: torch.optim.SGD(ps, lr=0.1, weight_decay=0.01, fused=True),
    ),
    "sgd_momentum": (
        lambda ps, **kw: SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01, **kw),
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01, fused=True),
    ),
    "sgd_nesterov": (
        lambda ps, **kw: SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01, **kw),
        lambda ps: torch.optim.SGD(
            ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01, fused=True
        ),
    ),
    "lion": (
        lambda ps, **kw: Lion(ps, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.01, **kw),
        lambda ps: ForeachLion(ps, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.01),
    ),
}


def run_rules(rules: list[str], sizes: list[int], steps: int) -> None:
    """The `--rule` table: each rule's native step against its torch peer (fp32 params)."""
    gpt2 = gpt2_small_shapes()
    cases = [(f"{n / 2**20:g}M", [(n,)]) for n in sizes] + [("gpt2-small", gpt2)]
    print("| rule | tensors | peer | peer ms | none+fp32 ms | ratio | exact+fp32 ms | ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for rule in rules:
        ours_of, peer_of = RULE_PAIRS[rule]
        for label, shapes in cases:
            peer = peer_of(_model_params(shapes, torch.float32))
            peer.step()  # makes its state
            peer_ms = min(_timed(peer.step) for _ in range(steps)) * 1e3
            cells = [rule, label, type(peer).__name__, f"{peer_ms:.1f}"]
            for master, dtype in (("none", torch.float32), ("exact", torch.bfloat16)):
                ours = ours_of(
                    _model_params(shapes, dtype), master=master, moments="fp32", fused=True
                )
                ratio = _paired(ours.step, peer.step, steps)
                assert set(ours.kernel_backends().values()) == {"native"}, ours.kernel_backends()
                best = min(_timed(ours.step) for _ in range(2))
                cells += [f"{best * 1e3:.1f}", f"{ratio:.2f}"]
                del ours
                gc.collect()
            print("| " + " | ".join(cells) + " |", flush=True)
            del peer
            gc.collect()


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
    parser.add_argument(
        "--inductor",
        default="",
        help="comma-separated combinations (or 'all') also run through torch.compile",
    )
    parser.add_argument("--model", choices=sorted(MODELS), help="a model's tensors instead")
    parser.add_argument(
        "--rule", default="", help="comma-separated update rules (or 'all') against torch's"
    )
    parser.add_argument(
        "--clock",
        choices=("wall", "thread"),
        default="wall",
        help="wall time, or this thread's CPU time (needs OMP_NUM_THREADS=1)",
    )
    args = parser.parse_args()
    if args.clock == "thread":
        if torch.get_num_threads() != 1:
            parser.error(
                "--clock thread times one thread: set OMP_NUM_THREADS=1 "
                f"(torch has {torch.get_num_threads()})"
            )
        global _clock
        _clock = time.thread_time
    all_combos: list[tuple[str, str]] = [(m, mo) for m in MASTER_KINDS for mo in MOMENT_KINDS]

    def parse(text: str) -> list[tuple[str, str]]:
        if text == "all":
            return all_combos
        return [(c.split("+")[0], c.split("+")[1]) for c in text.split(",") if c]

    combos, inductor_combos = parse(args.combos), parse(args.inductor)
    if args.rule:
        caps = device_caps("cpu")
        print(f"cpu: {caps.name}, torch {torch.__version__}, {torch.get_num_threads()} threads")
        rules = sorted(RULES) if args.rule == "all" else args.rule.split(",")
        run_rules(rules, [_size(s) for s in args.sizes.split(",")], args.steps)
        return
    if args.model:
        caps = device_caps("cpu")
        print(f"cpu: {caps.name}, torch {torch.__version__}, {torch.get_num_threads()} threads")
        run_model(args.model, combos, args.steps)
        return
    peers = [] if args.no_peers else _peers()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    try:
        info = native.library().info
        made = f"built in {info.build_seconds:.1f} s" if info.build_seconds else "cached"
        print(f"native kernel: {info.compiler} {' '.join(info.flags)} ({made})")
    except native.NativeUnavailableError as exc:
        print(f"native kernel unavailable: {exc}")
    for n in (_size(s) for s in args.sizes.split(",")):
        ref_opt = torch.optim.AdamW([_param(n, torch.float32)], fused=True)
        ref_opt.step()
        inplace = InPlacePass(n)
        best_pass = min(_timed(inplace) for _ in range(2 * args.steps))
        gbs = inplace.bandwidth(best_pass) / 1e9
        print(f"\n## {n / 2**20:g}M params; in-place elementwise pass {gbs:.1f} GB/s\n")
        print(
            "| optimizer | ms best / median | ratio | bytes/param | GB/s (of in-place) | first s |"
        )
        print("| --- | --- | --- | --- | --- | --- |")
        kw: dict[str, Any] = {"inplace": inplace, "steps": args.steps}
        for flag in ("fused", "foreach"):
            name = f"torch AdamW {flag} (fp32)"
            _print_row(measure(name, _torch_adamw(flag), torch.float32, n, ref_opt.step, **kw))
        for master, moments in combos:
            name = f"mixprec {master}+{moments}"
            _print_row(
                measure(name, _mixprec(master, moments), torch.bfloat16, n, ref_opt.step, **kw)
            )
        for master, moments in inductor_combos:
            name = f"mixprec {master}+{moments} (inductor)"
            factory = _mixprec(master, moments, inductor=True)
            _print_row(measure(name, factory, torch.bfloat16, n, ref_opt.step, **kw))
        for name, factory, dtype in peers:
            try:
                _print_row(measure(name, factory, dtype, n, ref_opt.step, **kw))
            except Exception as exc:  # a peer that does not run on this device
                print(f"| {name} | skipped: {type(exc).__name__}: {str(exc)[:80]} | | | | |")
        del ref_opt
        gc.collect()


if __name__ == "__main__":
    main()
