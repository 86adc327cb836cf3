"""What every command shares: the parser class, usage errors, tables, JSON output."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

__all__ = [
    "Handler",
    "Parser",
    "UsageError",
    "add_optimizer_flags",
    "emit_json",
    "load_mapping",
    "table",
]

#: A command: parsed arguments in, exit code out.
Handler = Callable[[argparse.Namespace], int]


class UsageError(Exception):
    """Bad input from the command line: exit code 2 with a one-line reason."""


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are `UsageError` (one line, exit code 2) and
    which takes no abbreviated flag (``compare --seed 3`` read as ``--seeds 3`` started
    a whole compare)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        if message.endswith("expected one argument"):
            # argparse reads a value that starts with '-' (``--shape -4x4x4``) as an option
            message += "; a value starting with '-' is written --option=VALUE"
        raise UsageError(f"{self.prog}: {message}")


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain-text table with left-aligned columns."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()
    rule = "  ".join("-" * w for w in widths)
    body = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join([line, rule, *body])


def emit_json(data: Any) -> None:
    """Write `data` as indented JSON to stdout."""
    json.dump(data, sys.stdout, indent=2)
    sys.stdout.write("\n")


def load_mapping(path: str | Any, what: str) -> dict[str, Any]:
    """A YAML (or JSON) file that must hold a mapping, read by the one safe loader."""
    from mixprec.safe_yaml import read_yaml_file

    data = read_yaml_file(path).data  # JSON is YAML too
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected {what}, got {type(data).__name__}")
    return data


def add_optimizer_flags(p: argparse.ArgumentParser) -> None:
    """``--optimizer`` and ``--optimizer-args`` (`compare` and `train`)."""
    p.add_argument(
        "--optimizer",
        default=None,
        metavar="NAME",
        help="the optimizer every run trains with: adamw (default), adam, sgd or lion "
        "(mixprec.optim, with the policy's master and moments)",
    )
    p.add_argument(
        "--optimizer-args",
        default=None,
        metavar="K=V[,K=V]",
        help="its keyword arguments, e.g. lr=0.05,momentum=0.9 or betas=(0.9,0.95); lr, "
        "weight_decay and betas are the run's training settings (sgd needs lr)",
    )
