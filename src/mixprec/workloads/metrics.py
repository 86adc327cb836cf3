"""Held-out metrics of the built-in workloads, as pure functions on tensors."""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["accuracy", "bits_per_char", "confusion_matrix", "macro_f1"]


def bits_per_char(loss_nats: float) -> float:
    """Convert a mean cross-entropy in nats per character to bits per character."""
    return loss_nats / math.log(2.0)


def confusion_matrix(pred: Tensor, target: Tensor, *, num_classes: int) -> Tensor:
    """Counts `C[t, p]` of examples with true class `t` predicted as `p` (int64)."""
    _check_labels(pred, target, num_classes)
    flat = target.reshape(-1).long() * num_classes + pred.reshape(-1).long()
    return torch.bincount(flat, minlength=num_classes * num_classes).reshape(
        num_classes, num_classes
    )


def macro_f1(pred: Tensor, target: Tensor, *, num_classes: int) -> float:
    """Unweighted mean of per-class F1 over classes that occur in `target` or `pred`.

    Per class, F1 = 2 TP / (2 TP + FP + FN). A class that is neither present
    nor predicted has no F1 and is left out of the mean; a present class that
    is never predicted correctly scores 0. This equals
    `sklearn.metrics.f1_score(target, pred, average="macro")`.

    Args:
        pred: Predicted class ids, any shape.
        target: True class ids, same number of elements as `pred`.
        num_classes: Number of classes; ids must lie in `[0, num_classes)`.
    """
    counts = confusion_matrix(pred, target, num_classes=num_classes).double()
    tp = counts.diagonal()
    fp = counts.sum(dim=0) - tp
    fn = counts.sum(dim=1) - tp
    denom = 2 * tp + fp + fn
    seen = denom > 0
    if not bool(seen.any()):
        raise ValueError("macro_f1 needs at least one example, got empty pred/target")
    return float((2 * tp[seen] / denom[seen]).mean())


def accuracy(pred: Tensor, target: Tensor) -> float:
    """Fraction of elements where `pred` equals `target`."""
    if pred.numel() != target.numel() or pred.numel() == 0:
        raise ValueError(
            f"accuracy needs equal, non-zero sizes, got {pred.numel()} and {target.numel()}"
        )
    return float((pred.reshape(-1) == target.reshape(-1)).double().mean())


def _check_labels(pred: Tensor, target: Tensor, num_classes: int) -> None:
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    if pred.numel() != target.numel():
        raise ValueError(
            f"pred and target must have equal sizes, got {pred.numel()} and {target.numel()}"
        )
    for name, labels in (("pred", pred), ("target", target)):
        if labels.is_floating_point() or labels.is_complex():
            raise ValueError(f"{name} must hold integer class ids, got dtype {labels.dtype}")
        if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= num_classes):
            raise ValueError(
                f"{name} ids must lie in [0, {num_classes}), got range "
                f"[{int(labels.min())}, {int(labels.max())}]"
            )
