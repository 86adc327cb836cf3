"""The digits workload: split, standardization, batches, training, macro-F1."""

from __future__ import annotations

import contextlib
import math
import sys
from collections import Counter
from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch import nn

from mixprec.workloads import Workload, digits, load_workload
from mixprec.workloads.digits import load_digits_split, stratified_split

sklearn_datasets = pytest.importorskip("sklearn.datasets")

TrainFn = Callable[..., nn.Module]


@pytest.fixture(scope="module")
def tiny() -> Workload:
    return load_workload("digits", size="tiny")


def _bf16() -> contextlib.AbstractContextManager[object]:
    return torch.autocast("cpu", dtype=torch.bfloat16)


def test_the_data_is_scikit_learns_read_without_importing_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each new process training digits imported scikit-learn (scipy.stats among it)
    only to read one bundled file: as long as importing torch."""
    from sklearn.datasets import load_digits

    want = load_digits()
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)  # importing it now fails
    features, labels = digits._load_digits_arrays.__wrapped__()
    assert features.dtype == np.float64 and labels.dtype == np.int64
    assert np.array_equal(features, want.data) and np.array_equal(labels, want.target)


def test_stratified_split_keeps_class_proportions() -> None:
    labels = sklearn_datasets.load_digits().target
    train, held = stratified_split(labels, held_out_fraction=0.2, seed=0)
    assert not set(train) & set(held)
    assert len(train) + len(held) == len(labels) == 1797
    for label in range(10):
        n_class = int((labels == label).sum())
        assert int((labels[held] == label).sum()) == round(n_class * 0.2)
    again_train, again_held = stratified_split(labels, held_out_fraction=0.2, seed=0)
    assert np.array_equal(held, again_held)
    assert np.array_equal(train, again_train)
    other = stratified_split(labels, held_out_fraction=0.2, seed=1)[1]
    assert not np.array_equal(held, other)


def test_inputs_standardized_with_training_statistics() -> None:
    bunch = sklearn_datasets.load_digits()
    data = load_digits_split()
    raw_train = bunch.data[data.train_index.numpy()]
    mean = raw_train.mean(axis=0)
    std = raw_train.std(axis=0)
    std[std == 0] = 1.0
    raw_held = bunch.data[data.held_out_index.numpy()]
    expected = torch.from_numpy(((raw_held - mean) / std).astype(np.float32))
    assert torch.allclose(data.held_out_x, expected)
    assert torch.equal(data.held_out_y, torch.from_numpy(bunch.target[data.held_out_index]))
    varying = raw_train.std(axis=0) > 0
    assert data.train_x[:, varying].mean(dim=0).abs().max() < 1e-5
    assert (data.train_x[:, varying].std(dim=0, unbiased=False) - 1).abs().max() < 1e-4


def test_same_seed_gives_bitwise_same_weights(tiny: Workload) -> None:
    a = tiny.make_model(0).state_dict()
    b = tiny.make_model(0).state_dict()
    c = tiny.make_model(1).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert all(t.dtype == torch.float32 for t in a.values())
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_batches_are_deterministic_and_cover_each_epoch(tiny: Workload) -> None:
    def batch(step: int, seed: int, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
        return tiny.train_batch(step=step, seed=seed, batch_size=size, device="cpu")

    torch.manual_seed(0)
    x, y = batch(3, 0)
    torch.manual_seed(1)
    assert torch.equal(batch(3, 0)[0], x)
    assert torch.equal(batch(3, 0)[1], y)
    assert not torch.equal(batch(4, 0)[0], x)
    assert not torch.equal(batch(3, 1)[0], x)
    assert x.shape == (32, 64)
    assert x.dtype == torch.float32
    assert y.dtype == torch.int64

    data = load_digits_split()
    n_train = data.train_y.numel()
    half = n_train // 2
    assert 2 * half == n_train  # two steps make exactly one epoch
    epoch_x = torch.cat([batch(0, 0, half)[0], batch(1, 0, half)[0]])

    def rows(t: torch.Tensor) -> Counter[tuple[float, ...]]:
        return Counter(map(tuple, t.tolist()))

    assert rows(epoch_x) == rows(data.train_x)
    # The next epoch is a different permutation of the same examples.
    next_x = torch.cat([batch(2, 0, half)[0], batch(3, 0, half)[0]])
    assert rows(next_x) == rows(data.train_x)
    assert not torch.equal(next_x, epoch_x)


def test_training_lowers_loss_and_macro_f1_is_sklearn(tiny: Workload, train: TrainFn) -> None:
    f1_score = pytest.importorskip("sklearn.metrics").f1_score
    before = tiny.evaluate(tiny.make_model(0), autocast=contextlib.nullcontext)
    model = train(tiny, steps=30)
    after = tiny.evaluate(model, autocast=contextlib.nullcontext)
    assert after.loss < before.loss - 0.5
    assert after.metric_name == "macro_f1"
    assert 0.0 <= after.metric <= 1.0
    assert after.metric > before.metric
    data = load_digits_split()
    with torch.no_grad():
        pred = model(data.held_out_x).argmax(dim=-1)
    expected = f1_score(data.held_out_y.numpy(), pred.numpy(), average="macro")
    assert after.metric == pytest.approx(expected, abs=1e-12)
    assert after.extras["accuracy"] == pytest.approx(
        float((pred == data.held_out_y).mean(dtype=torch.float64))
    )
    assert after.num_targets == data.held_out_y.numel()


def test_evaluate_under_bf16_autocast_restores_mode(tiny: Workload, train: TrainFn) -> None:
    model = train(tiny, steps=10)
    model.train()
    fp32 = tiny.evaluate(model, autocast=contextlib.nullcontext)
    bf16 = tiny.evaluate(model, autocast=_bf16)
    assert model.training
    assert math.isfinite(bf16.loss)
    assert bf16.loss == pytest.approx(fp32.loss, abs=0.05)
    assert 0.0 <= bf16.metric <= 1.0


def test_overrides_and_bad_values() -> None:
    workload = load_workload("digits", size="tiny", hidden_sizes=[16, 8])
    assert workload.config["hidden_sizes"] == (16, 8)
    assert "64-16-8-10" in workload.description
    with pytest.raises(ValueError, match=r"unknown digits option\(s\) 'hidden'; valid: "):
        load_workload("digits", hidden=8)
    with pytest.raises(ValueError, match=r"held_out_fraction must be in \(0, 1\)"):
        load_workload("digits", held_out_fraction=1.0)
    with pytest.raises(ValueError, match="hidden_sizes must be a sequence of positive ints"):
        load_workload("digits", hidden_sizes=(0,))
    with pytest.raises(ValueError, match="unknown digits size 'big'; valid: tiny, default"):
        load_workload("digits", size="big")
