"""load_workload: built-in names, user `module:function` workloads, clear errors."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from torch import nn

from mixprec.workloads import WORKLOADS, Workload, load_workload, workload_names

TrainFn = Callable[..., nn.Module]


@pytest.fixture
def user_modules(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Make the example user modules next to this file importable, then forget them."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    yield
    for name in ("example_user_workload", "broken_user_workload"):
        sys.modules.pop(name, None)


def test_builtin_names() -> None:
    assert workload_names() == ("digits", "shakespeare")
    assert set(WORKLOADS) == set(workload_names())
    workload = load_workload("digits", size="tiny")
    assert isinstance(workload, Workload)
    assert workload.name == "digits"
    assert workload.higher_is_better
    assert not load_workload("shakespeare", size="tiny").higher_is_better


@pytest.mark.usefixtures("user_modules")
def test_user_workload_by_module_function(train: TrainFn) -> None:
    workload = load_workload("example_user_workload:make_workload", n_features=4)
    assert workload.name == "linreg"
    assert workload.config["n_features"] == 4
    before = workload.evaluate(workload.make_model(0), autocast=contextlib.nullcontext)
    model = train(workload, steps=60)
    after = workload.evaluate(model, autocast=contextlib.nullcontext)
    assert after.loss < before.loss
    assert after.metric > 0.9  # R^2 of a linear model on linear data


@pytest.mark.parametrize(
    ("spec", "error", "match"),
    [
        ("shakespear", ValueError, r"unknown workload 'shakespear' \(did you mean 'shakespeare'"),
        ("nope", ValueError, "built-in: digits, shakespeare; or a user workload as 'module:func"),
        ("my module:make", ValueError, "malformed workload spec 'my module:make'"),
        ("example_user_workload:", ValueError, "malformed workload spec"),
        ("no_such_module_xyz:make", ValueError, "cannot import module 'no_such_module_xyz'"),
        ("example_user_workload:missing", ValueError, "has no attribute 'missing'"),
        ("example_user_workload:NOT_A_FUNCTION", TypeError, "is a int, not a callable"),
        ("example_user_workload:not_a_workload", TypeError, "returned str; it must return"),
    ],
)
@pytest.mark.usefixtures("user_modules")
def test_bad_specs_fail_clearly(spec: str, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        load_workload(spec)


@pytest.mark.usefixtures("user_modules")
def test_import_errors_inside_user_module_propagate() -> None:
    with pytest.raises(ModuleNotFoundError, match="mixprec_test_dependency_that_does_not_exist"):
        load_workload("broken_user_workload:make")


@pytest.mark.usefixtures("user_modules")
def test_config_file_specs_cannot_import() -> None:
    with pytest.raises(ValueError, match="would import 'example_user_workload', which is not"):
        load_workload("example_user_workload:make_workload", allow_import=False)
    assert "example_user_workload" not in sys.modules
    assert load_workload("digits", size="tiny", allow_import=False).name == "digits"


def test_overrides_reach_builtin_factory() -> None:
    with pytest.raises(ValueError, match=r"unknown digits option\(s\) 'widht'"):
        load_workload("digits", widht=3)
