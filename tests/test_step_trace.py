"""bench/step_trace.py: counts the functions, files and calls one step runs under a
package (issue 32's measure), and exits 1 over the budgets it is given."""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

import mixprec

BENCH = Path(__file__).resolve().parents[1] / "bench" / "step_trace.py"


@pytest.fixture(scope="module")
def step_trace() -> Iterator[ModuleType]:
    spec = importlib.util.spec_from_file_location("step_trace", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["step_trace"] = module  # its dataclass resolves annotations through it
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("step_trace", None)


TOY = """
def leaf():
    return 1

def twice():
    return leaf() + leaf()

class Box:
    def items(self):
        return [i for i in range(3)]

def fails():
    raise RuntimeError("inside")
"""

OUTSIDE = """
import toy

def outside():
    return toy.twice() + len(toy.Box().items())
"""


@pytest.fixture
def toy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[ModuleType, ModuleType, Path]]:
    """`toy` under ``tmp_path/pkg`` (the traced root); `outside` next to it, not under it."""
    root = tmp_path / "pkg"
    root.mkdir()
    (root / "toy.py").write_text(TOY)
    (tmp_path / "outside.py").write_text(OUTSIDE)
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.syspath_prepend(str(tmp_path))
    import outside  # type: ignore[import-not-found]
    import toy  # type: ignore[import-not-found]

    yield toy, outside, root
    sys.modules.pop("toy", None)
    sys.modules.pop("outside", None)


def test_a_function_counts_once_and_each_call_counts(step_trace: ModuleType, toy: tuple) -> None:
    _, outside, root = toy
    trace = step_trace.trace_calls(outside.outside, root)
    assert trace.calls_by_function == {
        "toy.py:twice": 1,
        "toy.py:leaf": 2,
        "toy.py:Box.items": 1,
        "toy.py:Box.items.<locals>.<listcomp>": 1,
    }
    assert (trace.functions, trace.files, trace.calls) == (4, 1, 5)
    assert trace.by_file() == {
        "toy.py": {"Box.items": 1, "Box.items.<locals>.<listcomp>": 1, "leaf": 2, "twice": 1}
    }


def test_files_outside_the_root_do_not_count(step_trace: ModuleType, toy: tuple) -> None:
    toy_module, outside, root = toy
    assert step_trace.trace_calls(outside.outside, root / "elsewhere").calls_by_function == {}
    assert step_trace.trace_calls(lambda: toy_module.leaf() + 1, root).calls == 1


def test_the_previous_profiler_is_back_after_an_error(step_trace: ModuleType, toy: tuple) -> None:
    toy_module, _, root = toy
    before = sys.getprofile()
    with pytest.raises(RuntimeError, match="inside"):
        step_trace.trace_calls(toy_module.fails, root)
    assert sys.getprofile() is before


def test_quickstart_traces_mixprec_and_exits_1_over_budget(
    step_trace: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(
        sys, "argv", ["step_trace.py", "--json", "--warmup", "2", "--max-functions", "1"]
    )
    with pytest.raises(SystemExit) as stop:
        step_trace.main()
    assert stop.value.code == 1
    record = json.loads(capsys.readouterr().out)
    package = Path(mixprec.__file__).parent
    for key in ("steady", "after_edit"):
        trace = record[key]
        assert trace["functions"] > 0 and trace["files"] > 0
        assert trace["calls"] >= trace["functions"]
        assert trace["files"] == len(trace["by_file"])
        assert all((package / file).is_file() for file in trace["by_file"])
    assert record["over_budget"] == [f"steady: {record['steady']['functions']} functions > 1"]


def test_the_runtime_share_of_a_steady_step_stays_within_its_budget(
    step_trace: ModuleType,
) -> None:
    """Issue 32: without loss scaling, the runtime (`engine/`, `islands.py`) runs at most
    14 functions in 4 files of a steady quickstart step (29 in 6 before the rework,
    with helpers and comprehensions in `gradients.py`, `scaling.py` and `stepping.py`)."""
    steady, _, _ = step_trace.quickstart("bf16_master", 2, "scale")
    runtime = sorted(
        name for name in steady.calls_by_function if name.startswith(("engine/", "islands.py"))
    )
    files = {name.split(":", 1)[0] for name in runtime}
    # 14 since `stepping.check_max_norm` left precision.py for the 600-line default
    assert len(runtime) <= 14 and len(files) <= 4, runtime


@pytest.mark.parametrize("edit", ["scale", "prune"])
def test_a_step_stays_within_issue_32s_budget(step_trace: ModuleType, edit: str) -> None:
    """The README loop under ``bf16_master``: at most 30 mixprec functions in 8 files
    for a steady step (52 in 13 before the rework), 40 in 10 for the step after an
    in-place weight edit (95 in 17)."""
    steady, after, _ = step_trace.quickstart("bf16_master", 2, edit)
    assert steady.functions <= 30 and steady.files <= 8, sorted(steady.calls_by_function)
    assert after.functions <= 40 and after.files <= 10, sorted(after.calls_by_function)
