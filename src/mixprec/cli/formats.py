"""`mixprec formats`: fp32/fp16/bf16/fp8 limits and what they mean for training."""

from __future__ import annotations

import argparse
from typing import Any

from mixprec.cli.common import emit_json, table

__all__ = ["add_parser"]


def add_parser(sub: Any) -> None:
    """Register the ``formats`` subcommand."""
    p = sub.add_parser("formats", help="fp32/fp16/bf16/fp8 limits and what they mean for training")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Print the table of formats (or JSON)."""
    from mixprec.dtypes import FORMAT_NAMES, format_info

    infos = [format_info(n) for n in FORMAT_NAMES]
    if args.json:
        emit_json({"formats": [{**i.to_dict(), "meaning": i.training_meaning()} for i in infos]})
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
    print(table(headers, rows))
    print()
    for i in infos:
        print(f"{i.name:9s} {i.training_meaning()}")
    return 0
