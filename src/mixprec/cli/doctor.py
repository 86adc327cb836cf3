"""``mixprec doctor FILE... [--json] [--format auto|mixprec|nemo]``.

`add_parser` registers the subcommand on the main CLI's subparsers; `run` is its
handler. Exit codes: 0 no errors found, 1 any finding is an error. Bad input (a
missing file, invalid YAML, an unknown format) raises `FileNotFoundError` or
`ValueError` with a one-line reason, which `mixprec.cli.exits` turns into exit
code 2 (also for ``python -m mixprec.doctor``).
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mixprec.doctor.findings import Finding

__all__ = ["add_parser", "format_report", "run"]


def add_parser(subparsers: argparse._SubParsersAction[Any]) -> None:
    """Register ``doctor`` on the main CLI's subparsers (handler: `run`)."""
    from mixprec.doctor.frontends.dispatch import FORMATS  # the registered front ends

    p = subparsers.add_parser(
        "doctor",
        help="lint training configs (mixprec YAML, NeMo AutoModel YAML)",
        description=(
            "Find precision problems in training configs before a run: each finding "
            "has a rule id, severity, location, evidence and fix. Exit code 1 when any "
            "finding is an error."
        ),
    )
    p.add_argument("files", nargs="+", metavar="FILE", help="config files to check")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--format",
        choices=FORMATS,
        default="auto",
        help="config format (default: detected from the content)",
    )
    p.set_defaults(handler=run)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def format_report(results: Sequence[tuple[str, str, Sequence[Finding]]]) -> str:
    """Human output: findings grouped by file, each with its fix underneath."""
    from mixprec.doctor.findings import count_by_severity

    lines: list[str] = []
    wrap = textwrap.TextWrapper(
        width=100,
        initial_indent=" " * 11,
        subsequent_indent=" " * 11,
        break_on_hyphens=False,
        break_long_words=False,
    )
    for path, fmt, findings in results:
        counts = count_by_severity(findings)
        summary = ", ".join(
            _plural(counts[s], s) for s in ("error", "warning", "info") if counts[s]
        )
        lines.append(f"{path} ({fmt}): {summary or 'no findings'}")
        for f in findings:
            lines.append(f"  {f.severity:<8} {f.rule}  [{f.where}]")
            lines.extend(wrap.wrap(f.message))
            lines.extend(wrap.wrap(f"fix: {f.fix}"))
        lines.append("")
    return "\n".join(lines).rstrip("\n")


def run(args: argparse.Namespace) -> int:
    """Check every file in ``args.files``; print findings; 1 if any is an error.

    Raises:
        FileNotFoundError: a file does not exist (one-line message).
        ValueError: a file is not valid YAML or not a recognizable config.
    """
    from mixprec.doctor.findings import has_errors
    from mixprec.doctor.frontends.dispatch import check_config
    from mixprec.doctor.frontends.document import read_config

    docs = [read_config(path) for path in args.files]
    results: list[tuple[str, str, list[Finding]]] = []
    for doc in docs:
        fmt, _, findings = check_config(doc, format=args.format)
        results.append((doc.source, fmt, findings))
    if args.json:
        payload = {
            "files": [
                {"file": path, "format": fmt, "findings": [f.to_dict() for f in findings]}
                for path, fmt, findings in results
            ]
        }
        json.dump(payload, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(format_report(results))
    return 1 if any(has_errors(findings) for _, _, findings in results) else 0
