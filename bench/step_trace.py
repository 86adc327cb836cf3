"""How deep one training step goes into mixprec: the functions, files and calls it runs.

Runs the README quickstart loop (a 3-layer MLP with a LayerNorm, ``prepare``,
``prec.optimizer``, then autocast, backward, ``clip_grad_norm_``, ``step``,
``zero_grad``), warms up, and traces exactly one steady step with
`sys.setprofile`, counting every Python frame whose file is under the
imported ``mixprec`` package. Then it edits a weight in place between steps
(``--edit``) and traces the next step the same way. Issue 32 sets the budgets
(30 functions in 8 files steady, 40 / 10 after an edit); pass them as
``--max-*`` to exit 1 when a trace exceeds them:

    OMP_NUM_THREADS=1 python bench/step_trace.py [--policy bf16_master] [--list] [--json]
    python bench/step_trace.py --max-functions 30 --max-files 8 \\
        --max-edit-functions 40 --max-edit-files 10

A function is ``file:qualname`` (file relative to the package); a call is one
``call`` profiler event, so a generator counts once per resume. Only the calling
thread is traced (backward runs there on CPU).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from torch import nn

import mixprec
from mixprec import device_caps

EDITS = ("scale", "prune")


@dataclass(frozen=True)
class Trace:
    """The mixprec frames one call ran: calls per ``file:qualname``."""

    calls_by_function: dict[str, int]

    @property
    def functions(self) -> int:
        return len(self.calls_by_function)

    @property
    def files(self) -> int:
        return len({name.split(":", 1)[0] for name in self.calls_by_function})

    @property
    def calls(self) -> int:
        return sum(self.calls_by_function.values())

    def summary(self) -> dict[str, int]:
        return {"functions": self.functions, "files": self.files, "calls": self.calls}

    def by_file(self) -> dict[str, dict[str, int]]:
        """Calls per function, grouped by file, files in path order."""
        out: dict[str, dict[str, int]] = {}
        for name in sorted(self.calls_by_function):
            file, qualname = name.split(":", 1)
            out.setdefault(file, {})[qualname] = self.calls_by_function[name]
        return out


def trace_calls(fn: Callable[[], object], root: Path) -> Trace:
    """Run `fn` once under `sys.setprofile`, counting the Python calls whose code
    lives in a file under `root` (C functions and other files are not counted)."""
    prefix = str(root.resolve()) + "/"
    calls: Counter[str] = Counter()
    names: dict[Any, str | None] = {}  # per code object: its name, or None outside root

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if event != "call":
            return
        code = frame.f_code
        name = names.get(code, "")
        if name == "":
            path = str(Path(code.co_filename).resolve())
            names[code] = name = (
                f"{path[len(prefix) :]}:{code.co_qualname}" if path.startswith(prefix) else None
            )
        if name is not None:
            calls[name] += 1

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(previous)
    return Trace(dict(calls))


def _model() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(32, 64),
        nn.LayerNorm(64),
        nn.ReLU(),
        nn.Linear(64, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )


def quickstart(policy: str, warmup: int, edit: str) -> tuple[Trace, Trace, str]:
    """Trace one steady step of the README quickstart loop and the step after an
    in-place weight edit; also say which update path the optimizer took."""
    torch.manual_seed(0)
    prec = mixprec.Precision(policy)
    model = prec.prepare(_model())
    optimizer = prec.optimizer(model, lr=3e-4, weight_decay=0.1)
    loss_fn = nn.CrossEntropyLoss()
    x, y = torch.randn(16, 32), torch.randint(0, 10, (16,))

    def step() -> None:  # the loop body, as the user writes it
        with prec.autocast():
            loss = loss_fn(model(x), y)
        prec.backward(loss)
        prec.clip_grad_norm_(model.parameters(), 1.0)
        prec.step(optimizer)
        optimizer.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    root = Path(mixprec.__file__).parent
    steady = trace_calls(step, root)
    with torch.no_grad():
        weight = next(model.parameters())  # the first Linear's weight
        if edit == "scale":
            weight.mul_(0.5)
        else:
            weight[: weight.shape[0] // 2].zero_()
    edited = trace_calls(step, root)
    return steady, edited, _update_path(optimizer)


def _update_path(optimizer: torch.optim.Optimizer) -> str:
    backends = getattr(optimizer, "kernel_backends", None)
    return repr(backends()) if callable(backends) else type(optimizer).__name__


def _over(trace: Trace, max_functions: int | None, max_files: int | None) -> list[str]:
    out = []
    if max_functions is not None and trace.functions > max_functions:
        out.append(f"{trace.functions} functions > {max_functions}")
    if max_files is not None and trace.files > max_files:
        out.append(f"{trace.files} files > {max_files}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--policy", default="bf16_master")
    parser.add_argument("--warmup", type=int, default=3, help="steps before the traced one")
    parser.add_argument("--edit", choices=EDITS, default="scale", help="the in-place weight edit")
    parser.add_argument("--list", action="store_true", help="functions by file, with calls")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    parser.add_argument("--max-functions", type=int, help="steady step budget (exit 1 over it)")
    parser.add_argument("--max-files", type=int, help="steady step budget (exit 1 over it)")
    parser.add_argument("--max-edit-functions", type=int, help="budget after the edit")
    parser.add_argument("--max-edit-files", type=int, help="budget after the edit")
    args = parser.parse_args()
    if args.warmup < 1:
        parser.error(f"--warmup must be at least 1, got {args.warmup}")

    steady, edited, path = quickstart(args.policy, args.warmup, args.edit)
    cpu = f"{device_caps('cpu').name} ({platform.machine()})"
    over = [f"steady: {m}" for m in _over(steady, args.max_functions, args.max_files)]
    over += [
        f"after {args.edit}: {m}"
        for m in _over(edited, args.max_edit_functions, args.max_edit_files)
    ]
    if args.json:
        record = {
            "cpu": cpu,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "policy": args.policy,
            "edit": args.edit,
            "update_path": path,
            "steady": {**steady.summary(), "by_file": steady.by_file()},
            "after_edit": {**edited.summary(), "by_file": edited.by_file()},
            "over_budget": over,
        }
        print(json.dumps(record, indent=2))
    else:
        print(f"cpu: {cpu}, torch {torch.__version__}, python {platform.python_version()}")
        print(f"policy {args.policy}, update path {path}, edit {args.edit}")
        print(f"{'step':<22}{'functions':>10}{'files':>7}{'calls':>7}")
        for label, trace in (("steady", steady), (f"after {args.edit}", edited)):
            print(f"{label:<22}{trace.functions:>10}{trace.files:>7}{trace.calls:>7}")
        if args.list:
            for label, trace in (("steady", steady), (f"after {args.edit}", edited)):
                print(f"\n## {label}")
                for file, functions in trace.by_file().items():
                    print(f"{file} ({len(functions)} functions, {sum(functions.values())} calls)")
                    for qualname, n in functions.items():
                        print(f"  {n:>4}  {qualname}")
        for message in over:
            print(f"over budget: {message}")
    sys.exit(1 if over else 0)


if __name__ == "__main__":
    main()
