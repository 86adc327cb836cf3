"""``mixprec doctor PATH... [--output text|json|github|sarif] [--format FORMAT]``.

`add_parser` registers the subcommand on the main CLI's subparsers; `run` is its
handler. Paths are files, directories (walked) and globs. Every file is judged on
its own: a file that cannot be read, or holds a value of an unexpected type, is a
``config-unreadable`` finding for that file, and the others are still judged.
Exit codes: 0 no errors found, 1 any finding is an error, 2 when a file could not
be read at all (missing, not valid YAML, no known format, not of the format
``--format`` names) or a folder or glob held no config file; the worst over all
files. Each of those is one line on stderr, and the text report leaves it out (the
machine-readable outputs list it too). An unknown ``--format`` raises
`ValueError`, which `mixprec.cli.exits` turns into exit code 2 (also for
``python -m mixprec.doctor``).
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mixprec.doctor.findings import Finding

__all__ = ["OUTPUTS", "add_parser", "format_report", "run"]

#: The values of ``--output``.
OUTPUTS: tuple[str, ...] = ("text", "json", "github", "sarif")


def add_parser(subparsers: argparse._SubParsersAction[Any]) -> None:
    """Register ``doctor`` on the main CLI's subparsers (handler: `run`)."""
    from mixprec.doctor.frontends.dispatch import FORMATS, FRONT_ENDS  # the registry

    p = subparsers.add_parser(
        "doctor",
        help=f"lint training configs ({', '.join(fe.name for fe in FRONT_ENDS)})",
        description=(
            "Find precision problems in training configs before a run: each finding "
            "has a rule id, severity, location, evidence and fix. Exit code 1 when any "
            "finding is an error, 2 when a file could not be read or a folder or glob "
            "held no config file."
        ),
    )
    p.add_argument(
        "files", nargs="+", metavar="PATH", help="config files, directories (walked) or globs"
    )
    p.add_argument(
        "--output",
        choices=OUTPUTS,
        default="text",
        help="text (default), json, github (workflow annotations) or sarif (SARIF 2.1.0)",
    )
    p.add_argument(
        "--json",
        dest="output",
        action="store_const",
        const="json",
        help="same as --output json",
    )
    p.add_argument(
        "--format",
        choices=FORMATS,
        default="auto",
        help="input config format (default: detected from the content)",
    )
    p.add_argument(
        "--skip-unknown",
        action="store_true",
        help=(
            "skip named files that parse but are of no known format (not a mapping, or no "
            "front end claims them) instead of reporting them (pre-commit)"
        ),
    )
    p.set_defaults(handler=run)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def format_report(
    results: Sequence[tuple[str, str, Sequence[Finding]]],
    *,
    skipped: int = 0,
    broken_links: int = 0,
    unknown: Mapping[str, Sequence[str]] | None = None,
) -> str:
    """Human output: findings grouped by file, each with its fix underneath, then
    the values left unknown (set by the run's environment) and the skipped count.
    Control characters (a newline in a file name) are escaped: one line each."""
    from mixprec.doctor.findings import count_by_severity
    from mixprec.doctor.output import printable

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
        lines.append(f"{printable(path)} ({fmt}): {summary or 'no findings'}")
        for f in findings:
            lines.append(f"  {f.severity:<8} {f.rule}  [{printable(f.where)}]")
            lines.extend(wrap.wrap(printable(f.message)))
            lines.extend(wrap.wrap(printable(f"fix: {f.fix}")))
        for value in (unknown or {}).get(path, ()):
            lines.append(f"  unknown  [{printable(value)}]: not judged")
        lines.append("")
    if skipped:
        lines.append(f"skipped {_plural(skipped, 'file')} of no known format")
    if broken_links:
        lines.append(f"skipped {_plural(broken_links, 'broken symbolic link')}")
    return "\n".join(lines).rstrip("\n")


def run(args: argparse.Namespace) -> int:
    """Check every file under ``args.files``; print findings; the worst exit code.

    Raises:
        ValueError: for an unknown ``--format``.
    """
    from mixprec.cli.interrupt import INTERRUPTED
    from mixprec.doctor.findings import has_errors
    from mixprec.doctor.frontends.batch import check_paths

    batch = check_paths(
        args.files,
        format=args.format,
        skip_unknown=getattr(args, "skip_unknown", False),
        should_stop=INTERRUPTED.is_set,  # Ctrl-C: print what was judged, then exit 130
    )
    results = [(f.source, f.format, list(f.findings)) for f in batch.files]
    read = [(f.source, f.format, list(f.findings)) for f in batch.files if f.readable]
    output = getattr(args, "output", "text")
    if output == "json":
        payload = {
            "files": [
                {
                    "file": f.source,
                    "format": f.format,
                    "findings": [x.to_dict() for x in f.findings],
                    "unknown": list(f.facts.unknown) if f.facts is not None else [],
                }
                for f in batch.files
            ],
            "skipped": len(batch.skipped),
            "skipped_broken_links": len(batch.broken_links),
        }
        json.dump(payload, sys.stdout, indent=2)
        sys.stdout.write("\n")
    elif output == "github":
        from mixprec.doctor.output import github_annotations

        sys.stdout.write(github_annotations(results))
    elif output == "sarif":
        from mixprec.doctor.output import sarif_log
        from mixprec.version import __version__

        json.dump(sarif_log(results, version=__version__), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        unknown = {f.source: f.facts.unknown for f in batch.files if f.facts is not None}
        text = format_report(
            read, skipped=len(batch.skipped), broken_links=len(batch.broken_links), unknown=unknown
        )
        if text:
            print(text)
    from mixprec.doctor.output import printable

    for report in batch.files:
        if not report.readable:  # one line on stderr (the text report leaves it out)
            finding = report.findings[0]
            line = f"mixprec doctor: {finding.where}: {finding.evidence['reason']}"
            print(printable(line), file=sys.stderr)
    if not batch.all_readable:
        return 2
    return 1 if any(has_errors(findings) for _, _, findings in results) else 0
