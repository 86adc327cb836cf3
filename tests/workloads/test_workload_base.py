"""The Workload shape and its helpers: validation, seeding, evaluation mode.

`TrainSettings` (a workload's defaults) is tested in `test_settings.py`.
"""

from __future__ import annotations

import contextlib
import json
import pickle
from dataclasses import FrozenInstanceError, asdict

import pytest
import torch
from torch import nn

from mixprec.workloads import (
    EvalResult,
    TrainSettings,
    Workload,
    batch_generator,
    evaluation_mode,
    model_device,
    seeded_init,
)
from mixprec.workloads.base import apply_overrides

DEFAULTS = TrainSettings(
    steps=10,
    batch_size=4,
    lr=1e-3,
    min_lr=1e-4,
    warmup_steps=2,
    weight_decay=0.0,
    grad_clip_norm=None,
)


def _workload(**changes: object) -> Workload:
    def evaluate(model: nn.Module, *, autocast: object) -> EvalResult:
        return EvalResult(loss=0.0, metric=0.0, metric_name="m", num_targets=1)

    fields: dict[str, object] = {
        "name": "w",
        "description": "d",
        "metric_name": "m",
        "higher_is_better": True,
        "defaults": DEFAULTS,
        "make_model": lambda seed: nn.Linear(1, 1),
        "train_batch": lambda **kw: (torch.zeros(1), torch.zeros(1)),
        "loss": lambda out, tgt: out.sum(),
        "evaluate": evaluate,
    }
    fields.update(changes)
    return Workload(**fields)  # type: ignore[arg-type]


def test_workload_validates_and_is_frozen() -> None:
    with pytest.raises(ValueError, match=r"Workload\.name must be a non-empty str"):
        _workload(name="")
    with pytest.raises(TypeError, match=r"Workload\.loss must be callable"):
        _workload(loss=3)
    with pytest.raises(TypeError, match=r"Workload\.defaults must be a TrainSettings"):
        _workload(defaults={"steps": 1})
    config: dict[str, object] = {"a": 1}
    workload = _workload(config=config)
    config["a"] = 2  # the workload keeps its own copy
    assert workload.config == {"a": 1}
    with pytest.raises(FrozenInstanceError):
        workload.name = "x"  # type: ignore[misc]


def test_eval_result_to_dict_pickles_and_copies_extras() -> None:
    extras = {"accuracy": 0.5}
    result = EvalResult(loss=1.0, metric=2.0, metric_name="m", num_targets=3, extras=extras)
    extras["accuracy"] = 0.0  # the result keeps its own copy
    assert result.to_dict() == {
        "loss": 1.0,
        "metric": 2.0,
        "metric_name": "m",
        "num_targets": 3,
        "extras": {"accuracy": 0.5},
    }
    assert asdict(result) == result.to_dict()
    assert pickle.loads(pickle.dumps(result)) == result
    assert json.loads(json.dumps(result.to_dict())) == result.to_dict()


def test_seeded_init_is_reproducible_and_leaves_global_rng_alone() -> None:
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    a = seeded_init(7, lambda: nn.Linear(4, 4))
    assert torch.equal(torch.rand(3), expected_next)
    b = seeded_init(7, lambda: nn.Linear(4, 4))
    c = seeded_init(8, lambda: nn.Linear(4, 4))
    assert isinstance(a, nn.Linear)
    assert isinstance(b, nn.Linear)
    assert isinstance(c, nn.Linear)
    assert torch.equal(a.weight, b.weight)
    assert not torch.equal(a.weight, c.weight)
    with pytest.raises(ValueError, match="seed must be a non-negative int"):
        seeded_init(-1, lambda: nn.Linear(1, 1))


def test_batch_generator_depends_on_seed_step_and_stream_only() -> None:
    def draw(seed: int, step: int, stream: str = "s") -> torch.Tensor:
        return torch.rand(4, generator=batch_generator(seed, step, stream=stream))

    torch.manual_seed(0)
    first = draw(1, 2)
    torch.manual_seed(99)
    assert torch.equal(draw(1, 2), first)
    assert not torch.equal(draw(2, 1), first)
    assert not torch.equal(draw(1, 3), first)
    assert not torch.equal(draw(1, 2, "other"), first)
    with pytest.raises(ValueError, match="step must be a non-negative int"):
        batch_generator(0, -1, stream="s")


def test_evaluation_mode_restores_each_submodule_mode() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5), nn.Linear(2, 2))
    model.train()
    model[1].eval()  # a submodule deliberately in eval mode
    with evaluation_mode(model):
        assert not any(m.training for m in model.modules())
        assert not torch.is_grad_enabled()
    assert [m.training for m in model.modules()] == [True, True, False, True]
    assert torch.is_grad_enabled()
    with contextlib.suppress(RuntimeError), evaluation_mode(model):
        raise RuntimeError("boom")
    assert [m.training for m in model.modules()] == [True, True, False, True]


def test_model_device() -> None:
    assert model_device(nn.Linear(1, 1)) == torch.device("cpu")
    assert model_device(nn.ReLU()) == torch.device("cpu")


def test_apply_overrides_rejects_unknown_names() -> None:
    assert apply_overrides(DEFAULTS, {"steps": 20}, what="x").steps == 20
    with pytest.raises(ValueError, match=r"unknown x option\(s\) 'stepz'; valid: batch_size, "):
        apply_overrides(DEFAULTS, {"stepz": 20}, what="x")
