"""Held-out metrics: macro-F1 against hand-computed values and scikit-learn."""

from __future__ import annotations

import math

import pytest
import torch

from mixprec.workloads.metrics import accuracy, bits_per_char, confusion_matrix, macro_f1


def test_macro_f1_hand_computed() -> None:
    # class 0: TP 2, FP 0, FN 1 -> 4/5; class 1: TP 1, FP 1, FN 1 -> 2/4;
    # class 2: TP 1, FP 1, FN 0 -> 2/3; class 3 never occurs and is left out.
    target = torch.tensor([0, 0, 0, 1, 1, 2])
    pred = torch.tensor([0, 0, 1, 1, 2, 2])
    expected = (4 / 5 + 1 / 2 + 2 / 3) / 3
    assert macro_f1(pred, target, num_classes=4) == pytest.approx(expected, abs=1e-12)
    assert macro_f1(pred, target, num_classes=3) == pytest.approx(59 / 90, abs=1e-12)


def test_macro_f1_class_never_predicted_scores_zero() -> None:
    # class 0: TP 1, FP 1 -> 2/3; class 1 is present but never predicted -> 0.
    target = torch.tensor([0, 1])
    pred = torch.tensor([0, 0])
    assert macro_f1(pred, target, num_classes=2) == pytest.approx(1 / 3, abs=1e-12)


def test_macro_f1_perfect_and_all_wrong() -> None:
    labels = torch.tensor([0, 1, 2, 2])
    assert macro_f1(labels, labels, num_classes=3) == 1.0
    assert macro_f1((labels + 1) % 3, labels, num_classes=3) == 0.0


@pytest.mark.parametrize("seed", range(6))
def test_macro_f1_matches_sklearn(seed: int) -> None:
    f1_score = pytest.importorskip("sklearn.metrics").f1_score
    generator = torch.Generator().manual_seed(seed)
    num_classes = 7
    target = torch.randint(0, num_classes, (50,), generator=generator)
    # Mostly right, with some classes (5, 6) never predicted.
    pred = torch.where(
        torch.rand(50, generator=generator) < 0.6,
        target,
        torch.randint(0, 5, (50,), generator=generator),
    )
    expected = f1_score(target.numpy(), pred.numpy(), average="macro", zero_division=0)
    assert macro_f1(pred, target, num_classes=num_classes) == pytest.approx(expected, abs=1e-12)


def test_confusion_matrix_counts() -> None:
    target = torch.tensor([0, 0, 1, 2])
    pred = torch.tensor([0, 1, 1, 0])
    expected = torch.tensor([[1, 1, 0], [0, 1, 0], [1, 0, 0]])
    assert torch.equal(confusion_matrix(pred, target, num_classes=3), expected)


@pytest.mark.parametrize(
    ("pred", "target", "match"),
    [
        (torch.tensor([0, 1]), torch.tensor([0]), "equal sizes"),
        (torch.tensor([0, 3]), torch.tensor([0, 1]), r"pred ids must lie in \[0, 3\)"),
        (torch.tensor([0.0, 1.0]), torch.tensor([0, 1]), "integer class ids"),
        (torch.tensor([], dtype=torch.long), torch.tensor([], dtype=torch.long), "at least one"),
    ],
)
def test_macro_f1_rejects_bad_input(pred: torch.Tensor, target: torch.Tensor, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        macro_f1(pred, target, num_classes=3)


def test_accuracy_and_bits_per_char() -> None:
    assert accuracy(torch.tensor([1, 2, 3, 4]), torch.tensor([1, 2, 0, 0])) == 0.5
    assert bits_per_char(math.log(2.0)) == pytest.approx(1.0)
    assert bits_per_char(math.log(65.0)) == pytest.approx(math.log2(65.0))
