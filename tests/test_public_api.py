"""The public surface: the names `mixprec` exports, the spellings it deprecates, and the
subpackages that are API (docs/architecture.md, "Public surface")."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import mixprec

#: What ``import mixprec`` offers (issue 32 item 5: at most 15 names).
TOP_LEVEL = {
    "Float8Training",
    "LossScaling",
    "PerformanceWarning",
    "Policy",
    "Precision",
    "PrecisionError",
    "PrecisionWarning",
    "StepReport",
    "compare",
    "device_caps",
    "preset",
    "report",
    "train",
}

#: Former top-level names -> where they live now; each still works, with a warning.
MOVED = {
    "ALIASES": "mixprec.policy",
    "PRESET_NAMES": "mixprec.policy",
    "preset_names": "mixprec.policy",
    "resolve_auto": "mixprec.policy",
    "DeviceCaps": "mixprec.device",
    "FormatInfo": "mixprec.dtypes",
    "dtype_name": "mixprec.dtypes",
    "format_info": "mixprec.dtypes",
    "parse_dtype": "mixprec.dtypes",
    "PrecisionPlan": "mixprec.engine",
    "PrecisionStats": "mixprec.engine",
    "StepObserver": "mixprec.engine",
    "Results": "mixprec.experiment.compare",
}

#: The subpackages and modules that are API: each lists its names in `__all__`.
PUBLIC_MODULES = (
    "checkpoint",
    "device",
    "distributed",
    "doctor",
    "dtypes",
    "engine",
    "errors",
    "experiment",
    "formats",
    "memory",
    "optim",
    "policy",
    "speed",
    "tracking",
    "workloads",
)


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-W", "error::DeprecationWarning", "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_mixprec_exports_exactly_the_public_names() -> None:
    assert set(mixprec.__all__) == TOP_LEVEL
    assert len(mixprec.__all__) <= 15
    assert set(dir(mixprec)) >= TOP_LEVEL


@pytest.mark.parametrize("package", ["mixprec", "mixprec.doctor", "mixprec.doctor.frontends"])
def test_type_checkers_see_the_names_a_lazy_package_exports(package: str) -> None:
    """A package that imports on first use (PEP 562) lists its API once, in `_EXPORTS`
    (`__all__` is derived); its `TYPE_CHECKING` imports, what mypy and editors read, must
    name the same."""
    module = importlib.import_module(package)
    with open(str(module.__file__), encoding="utf-8") as source:
        tree = ast.parse(source.read())
    guarded = next(
        n for n in tree.body if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test)
    )
    # `from m import X as X` re-exports X; an assignment (``report = rerender``) is exported.
    imported = {a.asname for n in guarded.body if isinstance(n, ast.ImportFrom) for a in n.names}
    assigned = {
        t.id
        for n in guarded.body
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Name)
    }
    assert (imported | assigned) - {None} == set(module.__all__)


def test_every_public_name_resolves_without_a_warning() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in TOP_LEVEL:
            assert getattr(mixprec, name) is not None


def test_import_mixprec_stays_torch_free() -> None:
    out = _run(
        "import sys, mixprec; "
        "print(sorted(m for m in ('torch', 'matplotlib', 'mixprec.optim.native') "
        "if m in sys.modules))"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_preset_is_the_lookup_and_mixprec_policy_the_subpackage() -> None:
    pol = mixprec.preset("bf16_master")
    assert isinstance(pol, mixprec.Policy) and pol.name == "bf16_master"
    assert importlib.import_module("mixprec.policy").Policy is mixprec.Policy


@pytest.mark.parametrize("order", ["import mixprec", "import mixprec.policy, mixprec"])
def test_the_old_call_mixprec_policy_still_works_and_names_the_new_spelling(order: str) -> None:
    """`mixprec.policy` was both the preset function and the subpackage; the call is
    deprecated in favour of `mixprec.preset`, whatever was imported first."""
    code = (
        f"{order}; import warnings\n"
        "with warnings.catch_warnings(record=True) as seen:\n"
        "    warnings.simplefilter('always')\n"
        "    name = mixprec.policy('fp32').name\n"
        "print(name, [str(w.message) for w in seen if w.category is DeprecationWarning])"
    )
    out = _run(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("fp32 [")
    assert "mixprec.preset(" in out.stdout


def test_the_old_import_of_the_preset_function_warns() -> None:
    with pytest.warns(DeprecationWarning, match=r"mixprec\.preset"):
        from mixprec.policy import policy  # noqa: F401 (the deprecated spelling)


@pytest.mark.parametrize(("name", "home"), sorted(MOVED.items()))
def test_a_name_dropped_from_the_top_level_warns_and_still_works(name: str, home: str) -> None:
    with pytest.warns(DeprecationWarning, match=rf"{home}\.{name}"):
        value = getattr(mixprec, name)
    assert value is getattr(importlib.import_module(home), name)
    assert name not in mixprec.__all__


def test_an_internal_module_is_not_imported_for_you_but_imports_as_usual() -> None:
    modules = ("islands", "safe_yaml", "telemetry", "userdirs")
    code = "import importlib, mixprec\n"
    for module in modules:
        code += (
            f"try:\n    mixprec.{module}\nexcept AttributeError as e:\n    print(e)\n"
            f"from mixprec import {module}\n"
            f"print({module} is importlib.import_module('mixprec.{module}'))\n"
        )
    out = _run(code)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    for module, (error, same) in zip(
        modules, zip(lines[::2], lines[1::2], strict=True), strict=True
    ):
        assert f"import mixprec.{module} explicitly" in error
        assert same == "True"


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no_such_name"):
        _ = mixprec.no_such_name  # type: ignore[attr-defined]


def test_public_modules_are_reachable_and_list_their_api() -> None:
    out = _run(
        "import mixprec\n"
        f"for name in {PUBLIC_MODULES!r}:\n"
        "    m = getattr(mixprec, name)\n"
        "    print(name, len(m.__all__) > 0 and all(hasattr(m, n) for n in m.__all__))"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [w for name in PUBLIC_MODULES for w in (name, "True")]


def test_docs_examples_and_benchmarks_use_no_deprecated_spelling() -> None:
    root = Path(__file__).resolve().parents[1]
    old = re.compile(rf"\bmixprec\.(?:policy\([\"']|(?:{'|'.join(MOVED)})\b)")
    files = [
        root / "README.md",
        *root.glob("docs/**/*.md"),
        *root.glob("examples/**/*.py"),
        *root.glob("bench/*.py"),
    ]
    found = [
        f"{path.relative_to(root)}:{number}: {line.strip()}"
        for path in files
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if old.search(line)
    ]
    assert not found, "\n".join(found)
