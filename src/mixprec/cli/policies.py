"""`mixprec policies`: the precision presets, their fields, aliases and what ``auto`` picks.

``--probe`` measures instead of reading device facts: it times fp32, bf16 and
fp16 autocast training steps of a workload's model (``--workload``/``--size``)
or of matmul shapes (``--shape``) on this device, through
`mixprec.speed.measure_speed`, and prints what ``auto`` picks from them.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from mixprec.cli.common import UsageError, emit_json, table
from mixprec.cli.interrupt import INTERRUPTED

if TYPE_CHECKING:
    from mixprec.speed import SpeedMeasurement

__all__ = ["add_parser"]

_PROBE_ONLY = ("workload", "size", "shape", "device", "repeats", "cache")


def add_parser(sub: Any) -> None:
    """Register the ``policies`` subcommand."""
    p = sub.add_parser("policies", help="the precision presets and their fields")
    p.add_argument(
        "--probe",
        action="store_true",
        help="measure what auto should pick here: time fp32, bf16 and fp16 training steps of a "
        "workload's model (default shakespeare) or of matmul shapes on this device (cached)",
    )
    p.add_argument(
        "--workload",
        default=None,
        help="with --probe: whose model is timed: shakespeare (default), digits, module:function",
    )
    p.add_argument(
        "--size", default=None, help="with --probe: the workload's size preset (e.g. small)"
    )
    p.add_argument(
        "--shape",
        action="append",
        default=None,
        metavar="MxNxK[,...]",
        help="with --probe, instead of a workload: matmul shapes to time as linear layers "
        "(M rows, N output features, K input features), e.g. 4096x4096x4096; repeatable",
    )
    p.add_argument(
        "--device",
        default=None,
        help="with --probe: device to time on (default cuda if any, else cpu)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="with --probe: timed steps per format, interleaved (default 5)",
    )
    p.add_argument(
        "--cache",
        default=None,
        choices=("use", "refresh", "off"),
        help="with --probe: use the measurement cache (default, or $MIXPREC_SPEED_CACHE), "
        "refresh it, or leave it off",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(handler=run)


def _check_args(args: argparse.Namespace) -> None:
    if not args.probe:
        given = [f"--{name}" for name in _PROBE_ONLY if getattr(args, name) is not None]
        if given:
            raise UsageError(f"mixprec policies: {', '.join(given)}: only with --probe")
        return
    if args.shape is not None and (args.workload is not None or args.size is not None):
        raise UsageError("mixprec policies: give --shape or --workload/--size, not both")
    from mixprec.speed import MAX_STEPS_PER_FORMAT

    if args.repeats is not None and not 1 <= args.repeats <= MAX_STEPS_PER_FORMAT:
        raise UsageError(
            f"mixprec policies: --repeats must be >= 1 and <= {MAX_STEPS_PER_FORMAT}, "
            f"got {args.repeats}"
        )


def _measure(args: argparse.Namespace) -> SpeedMeasurement:
    import torch

    from mixprec.device import resolve_device
    from mixprec.speed import measure_speed, parse_shapes

    repeats = 5 if args.repeats is None else args.repeats
    if args.shape is not None:
        shapes = parse_shapes(args.shape)  # bad shapes: ValueError, one line, exit 2
        device = resolve_device(args.device) if args.device is not None else None
        _progress(args, f"timing matmuls {','.join(map(str, shapes))}")
        with _bar(args) as progress:
            return measure_speed(
                shapes=shapes,
                device=device,
                repeats=repeats,
                cache=args.cache,
                should_stop=INTERRUPTED.is_set,
                progress=progress,
            )
    from mixprec.workloads import load_workload

    name = args.workload or "shakespeare"
    overrides = {} if args.size is None else {"size": args.size}
    workload = load_workload(name, allow_import=args.workload is not None, **overrides)
    device = resolve_device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = workload.make_model(0).to(device)
    x, y = workload.train_batch(
        step=0, seed=0, batch_size=workload.defaults.batch_size, device=device
    )
    label = f"{name} {args.size or 'default'}"
    _progress(args, f"timing {label}")

    def loss_fn(output: Any) -> torch.Tensor:
        return workload.loss(output, y)

    with _bar(args) as progress:
        return measure_speed(
            model,
            x,
            loss_fn=loss_fn,
            device=device,
            repeats=repeats,
            label=label,
            cache=args.cache,
            should_stop=INTERRUPTED.is_set,
            progress=progress,
        )


@contextlib.contextmanager
def _bar(args: argparse.Namespace) -> Iterator[Callable[[int, int], None] | None]:
    """A progress bar of the timed steps on stderr (none with --json)."""
    if args.json:
        yield None
        return
    from tqdm import tqdm

    with tqdm(desc="timing steps", unit="step", file=sys.stderr, leave=False) as bar:

        def progress(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)

        yield progress


def _progress(args: argparse.Namespace, what: str) -> None:
    if not args.json:
        print(
            f"mixprec policies --probe: {what} in fp32 and 16-bit autocast (unless cached)...",
            file=sys.stderr,
            flush=True,
        )


def _measurement_table(measured: SpeedMeasurement) -> str:
    best, median = measured.times(), measured.medians()
    ratio, median_ratio = measured.ratios(), measured.median_ratios()
    rows = [
        [
            name,
            f"{best[name] * 1e3:.1f}",
            f"{median[name] * 1e3:.1f}",
            f"{ratio[name]:.2f}x",
            f"{median_ratio[name]:.2f}x",
        ]
        for name in best
    ]
    rows += [[name, "-", "-", "not measured", "-"] for name in measured.skipped]
    return table(["format", "best ms", "median ms", "best vs fp32", "median vs fp32"], rows)


def _fp8_note() -> str:
    """What the fp8 column means, and whether torchao is here (found, not imported)."""
    import importlib.util

    note = (
        "the eligible nn.Linear layers train in FP8 through torchao's float8 training "
        "(that recipe, dynamic scaling; emulated where there are no FP8 units, as on every CPU)"
    )
    if importlib.util.find_spec("torchao") is None:
        note += "; torchao is not installed: pip install 'mixprec[fp8]'"
    return note


def run(args: argparse.Namespace) -> int:
    """Print the presets (or JSON); with ``--probe``, measure what ``auto`` picks."""
    from mixprec.policy import ALIASES, PRESET_NAMES, preset, resolve_auto

    _check_args(args)
    measured = _measure(args) if args.probe else None
    auto = resolve_auto(measured=measured)
    presets = [preset(n) for n in PRESET_NAMES]
    if args.json:
        emit_json(
            {
                "presets": [p.to_dict() for p in presets],
                "auto": {
                    "resolves_to": auto.name,
                    "reason": auto.note,
                    "source": "measured" if measured is not None else "device facts",
                    "measured": None if measured is None else measured.to_dict(),
                },
                "aliases": dict(sorted(ALIASES.items())),
            }
        )
        return 0
    if measured is not None:
        print(_measurement_table(measured))
        cache = f"cache: {measured.cache}"
        print(f"{cache} ({measured.cache_path})" if measured.cache_path else cache)
        print()
        print(f"auto      -> {auto.name}: {auto.note}")
        return 0
    rows = []
    for p in presets:
        d = p.to_dict()
        ls = d["loss_scaling"]
        scaling = (
            "-" if ls is None else ("dynamic" if ls["dynamic"] else f"static {ls['init_scale']:g}")
        )
        rows.append(
            [
                p.name,
                d["compute_dtype"],
                d["param_dtype"],
                d["master"],
                d["moments"],
                d["reduce_dtype"],
                scaling,
                "-" if p.fp8 is None else p.fp8.recipe,
                "yes" if p.release_gradients else "-",
            ]
        )
    print(
        table(
            [
                "preset",
                "compute",
                "params",
                "master",
                "moments",
                "reduce",
                "loss scaling",
                "fp8",
                "release",
            ],
            rows,
        )
    )
    print()
    print(f"fp8       {_fp8_note()}")
    print(f"auto      -> {auto.name}: {auto.note}")
    print("          (from device facts; `mixprec policies --probe` measures this machine)")
    by_target: dict[str, list[str]] = {}
    for alias, target in sorted(ALIASES.items()):
        by_target.setdefault(target, []).append(alias)
    print("aliases   " + "; ".join(f"{t}: {', '.join(a)}" for t, a in by_target.items()))
    return 0
