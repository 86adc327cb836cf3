"""Module sizes: no module under src/mixprec grows past the limit docs/architecture.md states.

The limits live in one place, the "Module sizes" table of docs/architecture.md:
its first row is the default for every module, each further row a module allowed
over it, held at its present size (so it can only shrink) and saying what will
cut it (for `optim/rule_optimizer.py`, the target of 450 lines). The test reads that
table, so the documentation and the test cannot disagree.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "src" / "mixprec"
ARCHITECTURE = REPO / "docs" / "architecture.md"

_ROW = re.compile(r"^\|\s*(?P<module>[^|]+?)\s*\|\s*(?P<limit>\d+)\s*\|(?P<why>[^|]*)\|\s*$")


def size_limits(text: str) -> tuple[int, dict[str, int]]:
    """The default limit and the per-module ceilings of the "Module sizes" table."""
    section = text.split("\n## Module sizes\n", 1)
    assert len(section) == 2, "docs/architecture.md has no '## Module sizes' section"
    body = section[1].split("\n## ", 1)[0]
    rows = [m for line in body.splitlines() if (m := _ROW.match(line))]
    assert rows, "the 'Module sizes' table of docs/architecture.md has no rows"
    first, *listed = rows
    assert first["module"] == "every other module", (
        f"the first row of 'Module sizes' must be the default ('every other module'), "
        f"got {first['module']!r}"
    )
    ceilings: dict[str, int] = {}
    for row in listed:
        name = row["module"].strip("`")
        assert name not in ceilings, f"{name} is listed twice in 'Module sizes'"
        assert row["why"].strip(), f"{name}: say why it is over the default and what cuts it"
        ceilings[name] = int(row["limit"])
    return int(first["limit"]), ceilings


def module_lines() -> dict[str, int]:
    """Lines of every Python module under src/mixprec, by path relative to it."""
    return {
        path.relative_to(PACKAGE).as_posix(): len(path.read_text(encoding="utf-8").splitlines())
        for path in sorted(PACKAGE.rglob("*.py"))
    }


def oversized(lines: dict[str, int], default: int, ceilings: dict[str, int]) -> list[str]:
    return [
        f"{name}: {n} lines, at most {ceilings.get(name, default)}"
        for name, n in sorted(lines.items())
        if n > ceilings.get(name, default)
    ]


def test_no_module_grows_past_its_stated_size() -> None:
    default, ceilings = size_limits(ARCHITECTURE.read_text(encoding="utf-8"))
    found = oversized(module_lines(), default, ceilings)
    assert not found, (
        "split the module along its concepts (one home per concept); a module over the "
        "default that a split would only scatter is listed, with why, in docs/architecture.md's "
        "'Module sizes' at its size, and may not grow: " + "; ".join(found)
    )


def test_a_module_allowed_over_the_default_is_held_at_its_present_size() -> None:
    default, ceilings = size_limits(ARCHITECTURE.read_text(encoding="utf-8"))
    lines = module_lines()
    for name, ceiling in ceilings.items():
        assert name in lines, f"'Module sizes' lists {name}, which is not under src/mixprec"
        if ceiling <= default:  # a tighter limit than the default: a target reached
            continue
        assert lines[name] > default, (
            f"{name} is {lines[name]} lines, within the default {default}: take its row out "
            "of 'Module sizes' (or make its limit a target below the default)"
        )
        assert lines[name] >= ceiling, (  # growing past it is the test above's
            f"{name} shrank to {lines[name]} lines: set its limit in 'Module sizes' to that "
            "(a module over the default is held at its present size, so it can only shrink)"
        )


def test_the_optimizer_class_is_listed_with_its_target() -> None:
    text = ARCHITECTURE.read_text(encoding="utf-8")
    _, ceilings = size_limits(text)
    name = "optim/rule_optimizer.py"
    row = next(line for line in text.splitlines() if line.startswith(f"| `{name}` |"))
    assert ceilings[name] <= 450 or "target 450" in row


@pytest.mark.parametrize(
    ("table", "problem"),
    [
        ("| every other module | 600 | the default |\n", "big.py: 601 lines, at most 600"),
        (
            "| every other module | 600 | the default |\n| `big.py` | 601 | one concept |\n",
            None,
        ),
        (
            "| every other module | 600 | the default |\n| `big.py` | 599 | one concept |\n",
            "big.py: 601 lines, at most 599",
        ),
    ],
)
def test_a_module_past_its_limit_is_named(table: str, problem: str | None) -> None:
    text = "# A\n\n## Module sizes\n\n| module | lines at most | why |\n| --- | --- | --- |\n"
    default, ceilings = size_limits(text + table + "\n## Next\n\n| `big.py` | 1 | no |\n")
    found = oversized({"big.py": 601, "small.py": 12}, default, ceilings)
    assert found == ([] if problem is None else [problem])
