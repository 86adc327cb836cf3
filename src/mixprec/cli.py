"""The `mixprec` command line.

Every subcommand takes ``--json`` for machine-readable output on stdout. Exit
codes: 0 success, 1 a check found errors or a gate failed, 2 bad input (with a
one-line reason on stderr).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal, NoReturn

__all__ = ["build_parser", "main"]

Handler = Callable[[argparse.Namespace], int]


class UsageError(Exception):
    """Bad input from the command line: exit code 2 with a one-line reason."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message}")


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))
    rule = "  ".join("-" * w for w in widths)
    body = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join([line, rule, *body])


def _emit_json(data: Any) -> None:
    json.dump(data, sys.stdout, indent=2)
    sys.stdout.write("\n")


# ------------------------------------------------------------------ formats


def _format_meaning(info: Any) -> str:
    from mixprec.dtypes import format_info

    fp32 = format_info("fp32")
    parts = [f"an update under {info.min_update_at_one * 100:.2g}% of a weight is lost"]
    if info.max < fp32.max / 2**8:
        parts.append(f"values above {info.max:g} overflow")
        parts.append(f"gradients below {info.smallest_subnormal:.2g} flush to 0: scale the loss")
    else:
        parts.append("fp32's range: no loss scaling needed")
    return "; ".join(parts)


def _cmd_formats(args: argparse.Namespace) -> int:
    from mixprec.dtypes import FORMAT_NAMES, format_info

    infos = [format_info(n) for n in FORMAT_NAMES]
    if args.json:
        _emit_json({"formats": [{**i.to_dict(), "meaning": _format_meaning(i)} for i in infos]})
        return 0
    rows = [
        [
            i.name,
            str(i.bits),
            f"{i.exponent_bits}/{i.mantissa_bits}",
            f"{i.eps:.3g}",
            f"{i.smallest_subnormal:.3g}",
            f"{i.smallest_normal:.3g}",
            f"{i.max:.3g}",
            f"{i.min_update_at_one:.3g}",
            f"{i.decimal_digits:.1f}",
        ]
        for i in infos
    ]
    headers = [
        "format",
        "bits",
        "exp/man",
        "eps",
        "min subnormal",
        "min normal",
        "max",
        "lost update @1.0",
        "digits",
    ]
    print(_table(headers, rows))
    print()
    for i in infos:
        print(f"{i.name:9s} {_format_meaning(i)}")
    return 0


# ----------------------------------------------------------------- policies


def _cmd_policies(args: argparse.Namespace) -> int:
    from mixprec.policy import ALIASES, PRESET_NAMES, policy, resolve_auto

    presets = [policy(n) for n in PRESET_NAMES]
    auto = resolve_auto()
    if args.json:
        _emit_json(
            {
                "presets": [p.to_dict() for p in presets],
                "auto": {"resolves_to": auto.name, "reason": auto.note},
                "aliases": dict(sorted(ALIASES.items())),
            }
        )
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
            ]
        )
    print(
        _table(["preset", "compute", "params", "master", "moments", "reduce", "loss scaling"], rows)
    )
    print()
    print(f"auto      -> {auto.name}: {auto.note}")
    by_target: dict[str, list[str]] = {}
    for alias, target in sorted(ALIASES.items()):
        by_target.setdefault(target, []).append(alias)
    print("aliases   " + "; ".join(f"{t}: {', '.join(a)}" for t, a in by_target.items()))
    return 0


# ------------------------------------------------------------------- budget

_MAX_COUNT = 1e15  # a thousand times today's largest models

_SUFFIX = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def _parse_count(text: str) -> int:
    """``7e9``, ``7B``, ``350M``, ``1_000`` -> an integer count."""
    raw = text.strip().lower().replace("_", "").replace(",", "")
    scale = 1.0
    if raw and raw[-1] in _SUFFIX:
        scale, raw = _SUFFIX[raw[-1]], raw[:-1]
    try:
        value = float(raw) * scale
    except ValueError:
        raise UsageError(f"mixprec budget: {text!r} is not a count (e.g. 7e9, 7B, 350M)") from None
    if not 1 <= value <= _MAX_COUNT:  # also refuses NaN and inf
        raise UsageError(
            f"mixprec budget: the count must be a number from 1 to {_MAX_COUNT:.0e} "
            f"(e.g. 7e9, 7B, 350M), got {text!r}"
        )
    return round(value)


def _load_config(path: str) -> dict[str, Any]:
    from mixprec.safe_yaml import read_yaml_file

    data = read_yaml_file(path).data  # JSON is YAML too
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of config keys, got {type(data).__name__}")
    return data


def _cmd_budget(args: argparse.Namespace) -> int:
    from mixprec.memory import TransformerShape, estimate
    from mixprec.policy import PRESET_NAMES

    if (args.params is None) == (args.config is None):
        raise UsageError("mixprec budget: give exactly one of --params N or --config FILE")
    if args.world_size < 1:
        raise UsageError(f"mixprec budget: --world-size must be >= 1, got {args.world_size}")
    if args.config is None and (args.seq_len is not None or args.micro_batch is not None):
        raise UsageError(
            "mixprec budget: --seq-len and --micro-batch size activations from a model config: "
            "give --config FILE, or --activations N with --params"
        )
    if args.sharding is not None and args.world_size == 1:
        raise UsageError(
            f"mixprec budget: --sharding {args.sharding} needs --world-size > 1 (one rank "
            "shards nothing)"
        )
    for flag, value in (("--seq-len", args.seq_len), ("--micro-batch", args.micro_batch)):
        if value is not None and value < 1:
            raise UsageError(f"mixprec budget: {flag} must be >= 1, got {value}")
    names = (
        list(PRESET_NAMES) if args.policy == "all" else [n.strip() for n in args.policy.split(",")]
    )
    source: Any
    if args.config is not None:
        try:
            source = TransformerShape.from_config(
                _load_config(args.config), seq_len=args.seq_len, micro_batch=args.micro_batch
            )
        except ValueError as exc:
            raise ValueError(f"{args.config}: {exc}") from None
        total = sum(source.param_counts())
        if total > _MAX_COUNT:
            raise UsageError(
                f"mixprec budget: {args.config} describes {total:.3g} parameters, more than "
                f"{_MAX_COUNT:.0e}: check its sizes"
            )
    else:
        source = _parse_count(args.params)
    activations = _parse_count(args.activations) if args.activations else None
    sharding: Literal["none", "fsdp", "ddp"] = (
        (args.sharding or "fsdp") if args.world_size > 1 else "none"
    )
    results = [
        estimate(
            source,
            n,
            world_size=args.world_size,
            sharding=sharding,
            activation_values=activations,
        )
        for n in names
    ]
    if args.json:
        payload = [r.to_dict() for r in results]
        _emit_json(payload if len(payload) > 1 else payload[0])
        return 0
    print(_budget_table(results, args.world_size))
    return 0


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def _budget_table(results: Sequence[Any], world_size: int) -> str:
    from mixprec.memory import COMPONENTS

    first = results[0]
    head = f"{first.params:,} parameters"
    if world_size > 1:
        head += f", {world_size} ranks ({first.sharding})"
    lines = [f"Memory by component (GiB), {head}", ""]
    headers = ["component", *[r.policy for r in results]]
    rows = []
    for comp in COMPONENTS:
        rows.append([comp, *[_gib(getattr(r.bytes, comp)) for r in results]])
    rows.append(["total", *[_gib(r.bytes.total) for r in results]])
    rows.append(["bytes/param", *[f"{r.state_bytes_per_param:.2f}" for r in results]])
    if world_size > 1:
        rows.append(["per rank", *[_gib(r.per_rank.total) for r in results]])
        for key in ("all_gather", "reduce_scatter", "all_reduce"):
            if any(r.comm_bytes_per_step.get(key) for r in results):
                rows.append([f"{key}/step", *[_gib(r.comm_bytes_per_step[key]) for r in results]])
    lines.append(_table(headers, rows))
    notes = sorted({n for r in results for n in r.notes})
    lines += ["", *[f"note: {n}" for n in notes]] if notes else []
    lines.append("bytes/param: training state (params, grads, master, moments) per parameter")
    return "\n".join(lines)


# ------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (subcommands and flags are pinned by a test)."""
    parser = _Parser(
        prog="mixprec",
        description="Mixed-precision training for PyTorch: fast, correct by default, provable.",
    )
    parser.add_argument("--version", action="version", version=_version())
    parser.add_argument(
        "--traceback",
        action="store_true",
        help="show the whole traceback of an error (also MIXPREC_DEBUG=1); give it first",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    p = sub.add_parser("formats", help="fp32/fp16/bf16/fp8 limits and what they mean for training")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(handler=_cmd_formats)

    p = sub.add_parser("policies", help="the precision presets and their fields")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(handler=_cmd_policies)

    from mixprec.doctor.cli import add_parser as add_doctor_parser

    add_doctor_parser(sub)

    p = sub.add_parser("budget", help="memory and communication by component for a policy")
    p.add_argument("--params", default=None, help="parameter count (7e9, 7B, 350M)")
    p.add_argument("--config", default=None, help="a transformers-style config (JSON or YAML)")
    p.add_argument("--policy", default="all", help="a preset, comma-separated presets, or all")
    p.add_argument("--world-size", type=int, default=1, help="number of ranks")
    p.add_argument(
        "--sharding",
        choices=["fsdp", "ddp"],
        default=None,
        help="with --world-size > 1 (default fsdp)",
    )
    p.add_argument("--seq-len", type=int, default=None, help="sequence length (with --config)")
    p.add_argument(
        "--micro-batch", type=int, default=None, help="sequences per rank (with --config)"
    )
    p.add_argument("--activations", default=None, help="activation values saved for backward")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(handler=_cmd_budget)

    from mixprec.experiment.cli import add_parsers as add_experiment

    add_experiment(sub)
    return parser


def _version() -> str:
    from mixprec import __version__

    return f"mixprec {__version__}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _silence_stdout() -> None:
    """After a broken pipe (``mixprec ... | head``): drop what is left to print."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # pragma: no cover - stdout without a file descriptor
        pass


#: Set by the first Ctrl-C; long commands stop at their next safe point (see `main`).
INTERRUPTED = threading.Event()


def _on_sigint(signum: int, frame: Any) -> None:
    # An asynchronous KeyboardInterrupt can land inside an import (numpy then recursed
    # without end on its next import) or in a Python callback of torch's C++ code
    # (pybind11 aborts the process). The first Ctrl-C only sets a flag that compare
    # checks before each training step; a second one interrupts at once.
    if INTERRUPTED.is_set():
        raise KeyboardInterrupt
    INTERRUPTED.set()


@contextlib.contextmanager
def _cooperative_sigint() -> Iterator[None]:
    import signal

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    INTERRUPTED.clear()
    previous = signal.signal(signal.SIGINT, _on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _interrupted_exit() -> int:
    print(
        "mixprec: interrupted; finished work is kept (compare: rerun the same command to resume)",
        file=sys.stderr,
    )
    return 130


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (see `_main`)."""
    with _cooperative_sigint():
        code = _main(argv)
        if INTERRUPTED.is_set() and code != 130:
            return _interrupted_exit()
        return code


def _main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code.

    Exit codes: 0 success; 1 a check found errors (doctor) or nothing could be
    recommended (compare); 2 bad input or any other error, with one line on
    stderr (``--traceback`` or ``MIXPREC_DEBUG=1`` shows the whole traceback);
    130 interrupted (Ctrl-C).
    """
    import os

    args_list = list(sys.argv[1:] if argv is None else argv)
    debug = os.environ.get("MIXPREC_DEBUG", "") not in ("", "0")
    if "--traceback" in args_list[:1]:
        args_list = args_list[1:]
        debug = True
    try:
        parser = build_parser()  # imports torch: Ctrl-C here is one line too
        args = parser.parse_args(args_list)
        handler: Handler = args.handler
        code = handler(args)
        sys.stdout.flush()
        return code
    except BrokenPipeError:  # e.g. piped into `head`
        _silence_stdout()
        return 0
    except UsageError as exc:
        print(_first_line(exc), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return _interrupted_exit()
    except Exception as exc:
        if debug:
            import traceback

            traceback.print_exc(file=sys.stderr)
        known = isinstance(exc, ValueError | TypeError | OSError | ImportError | LookupError)
        what = "" if known else f"{type(exc).__name__}: "
        hint = "" if debug else " (rerun with --traceback or MIXPREC_DEBUG=1 for details)"
        print(
            f"mixprec: error: {what}{_first_line(exc)}{hint if not known else ''}", file=sys.stderr
        )
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
