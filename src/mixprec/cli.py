"""The `mixprec` command line.

Every subcommand takes ``--json`` for machine-readable output on stdout. Exit
codes: 0 success, 1 a check found errors or a gate failed, 2 bad input (with a
one-line reason on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

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
    from mixprec.errors import PrecisionWarning
    from mixprec.policy import ALIASES, PRESET_NAMES, policy, resolve_auto

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PrecisionWarning)
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


# ------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (subcommands and flags are pinned by a test)."""
    parser = _Parser(
        prog="mixprec",
        description="Mixed-precision training for PyTorch: fast, correct by default, provable.",
    )
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    p = sub.add_parser("formats", help="fp32/fp16/bf16/fp8 limits and what they mean for training")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(handler=_cmd_formats)

    p = sub.add_parser("policies", help="the precision presets and their fields")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(handler=_cmd_policies)
    return parser


def _version() -> str:
    from mixprec import __version__

    return f"mixprec {__version__}"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        handler: Handler = args.handler
        return handler(args)
    except BrokenPipeError:  # e.g. piped into `head`
        return 0
    except UsageError as exc:
        print(str(exc).splitlines()[0], file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError) as exc:
        print(
            f"mixprec: error: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}",
            file=sys.stderr,
        )
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
