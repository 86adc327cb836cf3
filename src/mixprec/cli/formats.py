"""`mixprec formats`: fp32/fp16/bf16/fp8 limits and what they mean for training, and the
optimizer's storage formats (masters and moments) with their bytes per parameter."""

from __future__ import annotations

import argparse
from typing import Any

from mixprec.cli.common import emit_json, table

__all__ = ["add_parser"]


def add_parser(sub: Any) -> None:
    """Register the ``formats`` subcommand."""
    p = sub.add_parser("formats", help="number formats and the optimizer's storage formats")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(handler=run)


#: The matrix the moment bytes per parameter are given for: GPT-2 small's 768 x 768
#: attention projection (int8: blocks of 256; int4: one fp32 per row and per column).
_MATRIX = (768, 768)


def _storage() -> dict[str, list[dict[str, Any]]]:
    """The registered master and moment formats: name, bytes per parameter, summary."""
    from mixprec.formats import registry

    rows, cols = _MATRIX
    masters = [
        {"name": s.name, "bytes_per_param": s.bytes_per_element, "summary": s.summary}
        for s in registry.master_specs()
    ]
    moments = [
        {
            "name": s.name,
            "bytes_per_param": s.nbytes(rows * cols, block_size=256, rows=rows) / (rows * cols),
            "summary": s.summary,
        }
        for s in registry.moment_specs()
    ]
    return {"masters": masters, "moments": moments}


def run(args: argparse.Namespace) -> int:
    """Print the table of formats (or JSON)."""
    from mixprec.dtypes import FORMAT_NAMES, format_info

    infos = [format_info(n) for n in FORMAT_NAMES]
    storage = _storage()
    if args.json:
        emit_json(
            {
                "formats": [{**i.to_dict(), "meaning": i.training_meaning()} for i in infos],
                **storage,
            }
        )
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
    print()
    for kind, what in (("masters", "master"), ("moments", "moments (AdamW's two)")):
        print(
            table(
                [what, "B/param", "what it stores"],
                [[f["name"], f"{f['bytes_per_param']:.3g}", f["summary"]] for f in storage[kind]],
            )
        )
        print()
    print(
        f"B/param: optimizer state per parameter element, the parameter not counted (moments: "
        f"on a {_MATRIX[0]} x {_MATRIX[1]} matrix)"
    )
    return 0
