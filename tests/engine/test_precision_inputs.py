"""`Precision`'s own arguments: bad values raise naming the value, never pass silently."""

from __future__ import annotations

import pytest
import torch

from mixprec import Precision


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"min_loss_scale": -1}, "min_loss_scale"),
        ({"min_loss_scale": 0.0}, "min_loss_scale"),
        ({"min_loss_scale": float("inf")}, "min_loss_scale"),
        ({"min_loss_scale": "1"}, "min_loss_scale"),
        ({"max_consecutive_skips": 1.5}, "max_consecutive_skips"),
        ({"max_consecutive_skips": 0}, "max_consecutive_skips"),
        ({"max_consecutive_skips": True}, "max_consecutive_skips"),
        ({"history_size": 2.5}, "history_size"),
    ],
)
def test_bad_limits_are_refused(kwargs: dict[str, object], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        Precision("amp_fp16", **kwargs)  # type: ignore[arg-type]


def test_limits_may_be_turned_off() -> None:
    prec = Precision("amp_fp16", min_loss_scale=None, max_consecutive_skips=None)
    assert prec.min_loss_scale is None and prec.max_consecutive_skips is None


@pytest.mark.parametrize("params", [[], torch.nn.Identity()])
def test_an_optimizer_of_no_parameters_is_refused_as_torch_refuses_it(params: object) -> None:
    """prec.optimizer([]) built an empty optimizer where AdamW([]) raises."""
    with pytest.raises(ValueError, match="empty parameter list"):
        Precision("fp32").optimizer(params)  # type: ignore[arg-type]
