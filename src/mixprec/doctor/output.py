"""Findings in the formats the places linters run read: GitHub annotations, SARIF.

`github_annotations` writes GitHub Actions workflow commands
(``::error file=F,line=L,title=RULE::message``), escaped as the runner expects:
``%``, CR and LF in the message; also ``:`` and ``,`` in properties. `sarif_log`
builds a SARIF 2.1.0 log (one run; the rule registry as ``tool.driver.rules``;
one result per finding with its file and start line) for code-scanning uploads.
Both are pure functions of ``(file, format, findings)`` triples.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from mixprec.doctor.findings import RULES, Finding

__all__ = [
    "SARIF_SCHEMA",
    "SARIF_VERSION",
    "escape_data",
    "escape_property",
    "github_annotations",
    "location_of",
    "sarif_log",
]

#: The SARIF version written, and the schema a log names.
SARIF_VERSION = "2.1.0"
SARIF_SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"

_GITHUB_LEVEL = {"error": "error", "warning": "warning", "info": "notice"}
_SARIF_LEVEL = {"error": "error", "warning": "warning", "info": "note"}

Results = Sequence[tuple[str, str, Sequence[Finding]]]


def escape_data(text: str) -> str:
    """A workflow command's message, escaped (``%``, CR, LF)."""
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def escape_property(text: str) -> str:
    """A workflow command's property value, escaped (also ``:`` and ``,``)."""
    return escape_data(text).replace(":", "%3A").replace(",", "%2C")


def location_of(source: str, finding: Finding) -> tuple[str, int | None]:
    """The file and 1-based line of a finding (``where`` is ``"file:line key"``)."""
    where = finding.where
    if where.startswith(source):
        match = re.match(r":(\d+)\b", where[len(source) :])
        return source, int(match.group(1)) if match else None
    return source, None


def github_annotations(results: Results) -> str:
    """One workflow command per finding, each on its own line."""
    lines: list[str] = []
    for source, _, findings in results:
        for f in findings:
            path, line = location_of(source, f)
            props = [f"file={escape_property(path)}"]
            if line is not None:
                props.append(f"line={line}")
            props.append(f"title={escape_property(f.rule)}")
            message = f"{f.message} (fix: {f.fix})"
            lines.append(f"::{_GITHUB_LEVEL[f.severity]} {','.join(props)}::{escape_data(message)}")
    return "".join(line + "\n" for line in lines)


def sarif_log(results: Results, *, version: str = "") -> dict[str, Any]:
    """A SARIF 2.1.0 log of the findings (JSON-ready)."""
    rule_ids = list(RULES)
    rules = [
        {
            "id": info.id,
            "name": info.id,
            "shortDescription": {"text": info.summary},
            "properties": {"kind": info.kind},
        }
        for info in RULES.values()
    ]
    out: list[dict[str, Any]] = []
    for source, _, findings in results:
        for f in findings:
            path, line = location_of(source, f)
            physical: dict[str, Any] = {"artifactLocation": {"uri": path}}
            if line is not None:
                physical["region"] = {"startLine": line}
            out.append(
                {
                    "ruleId": f.rule,
                    "ruleIndex": rule_ids.index(f.rule),
                    "level": _SARIF_LEVEL[f.severity],
                    "message": {"text": f"{f.message} (fix: {f.fix})"},
                    "locations": [{"physicalLocation": physical}],
                    "properties": {"where": f.where, "evidence": dict(f.evidence)},
                }
            )
    driver: dict[str, Any] = {
        "name": "mixprec-doctor",
        "rules": rules,
    }
    if version:
        driver["version"] = version
    return {
        "$schema": SARIF_SCHEMA,
        "version": SARIF_VERSION,
        "runs": [{"tool": {"driver": driver}, "results": out}],
    }
