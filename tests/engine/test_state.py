"""`Precision.state_dict` / `load_state_dict`: a resumed run continues identically."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from mixprec import LossScaling, Policy, Precision

from .helpers import grad_step, make_model

pytestmark = pytest.mark.usefixtures("quiet_expected_warnings")


def test_state_dict_round_trip_continues_identically() -> None:
    def run(
        prec: Precision, model: nn.Module, opt: torch.optim.Optimizer, steps: range
    ) -> list[float | None]:
        out = []
        for i in steps:
            grad_step(prec, model, opt, inject=i in (2, 5))
            out.append(prec.loss_scale)
        return out

    policy = Policy(compute_dtype=torch.float16, loss_scaling=LossScaling(growth_interval=2))
    a = Precision(policy)
    model_a = a.prepare(make_model())
    opt_a = torch.optim.SGD(model_a.parameters(), lr=1e-3)
    run(a, model_a, opt_a, range(4))
    saved = torch.load(_roundtrip(a.state_dict()), weights_only=True)
    model_b = copy.deepcopy(model_a)
    opt_b = torch.optim.SGD(model_b.parameters(), lr=1e-3)
    opt_b.load_state_dict(opt_a.state_dict())
    b = Precision(policy)
    b.prepare(model_b)
    b.load_state_dict(saved)
    assert b.stats.to_dict() == a.stats.to_dict()
    assert run(a, model_a, opt_a, range(4, 10)) == run(b, model_b, opt_b, range(4, 10))
    assert b.stats.to_dict() == a.stats.to_dict()
    with pytest.raises(ValueError, match="different policy"):
        Precision("amp_bf16").load_state_dict(saved)
    Precision("amp_bf16").load_state_dict(saved, strict=False)


def _roundtrip(state: dict[str, object]) -> object:
    import io

    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return buf
