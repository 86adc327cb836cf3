"""`mixprec policies`: the precision presets, their fields, aliases and what ``auto`` picks."""

from __future__ import annotations

import argparse
from typing import Any

from mixprec.cli.common import emit_json, table

__all__ = ["add_parser"]


def add_parser(sub: Any) -> None:
    """Register the ``policies`` subcommand."""
    p = sub.add_parser("policies", help="the precision presets and their fields")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Print the presets (or JSON)."""
    from mixprec.policy import ALIASES, PRESET_NAMES, policy, resolve_auto

    presets = [policy(n) for n in PRESET_NAMES]
    auto = resolve_auto()
    if args.json:
        emit_json(
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
        table(["preset", "compute", "params", "master", "moments", "reduce", "loss scaling"], rows)
    )
    print()
    print(f"auto      -> {auto.name}: {auto.note}")
    by_target: dict[str, list[str]] = {}
    for alias, target in sorted(ALIASES.items()):
        by_target.setdefault(target, []).append(alias)
    print("aliases   " + "; ".join(f"{t}: {', '.join(a)}" for t, a in by_target.items()))
    return 0
