"""Checkpoints of 2-rank runs (FSDP2 shards, DDP replicas): one checkpoint, loaded
bitwise into 2 ranks, resharded into 1 process (and from 1 into 2), refused together.

Two gloo processes run `sharded_worker.py` (every scenario in one launch); this
process builds the single-process side of each comparison.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from mixprec import checkpoint
from ranks import launch

from . import sharded_cases as cases

WORKER = Path(__file__).with_name("sharded_worker.py")

#: 2 ranks against 1 process on the same global batch: each rank's half of the
#: gradient is summed on its own and the halves are then reduced in fp32 across
#: ranks, where one process sums all 32 rows at once. The gradients differ in their
#: last bits, the updates and the bf16 roundings of the weights follow, and the
#: losses drift apart: by up to 2e-5 (relative) over 3 steps here, against
#: 0.03-0.3 of change per step.
LOSS_RTOL = 2e-4


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _single_checkpoint(root: Path) -> list[float]:
    """A one-process run of `SAVE_AT` steps on the whole batch, saved; then on to the end."""
    cases.seed_everything(0)
    model, opt, prec = cases.build("bf16_master")
    losses = cases.train(model, opt, prec, 0, cases.SAVE_AT)
    checkpoint.save(root, model=model, optimizer=opt, precision=prec, step=cases.SAVE_AT)
    return losses + cases.train(model, opt, prec, cases.SAVE_AT, cases.STEPS)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("sharded")
    root = out / "checkpoints"
    single_losses = _single_checkpoint(root / "single")
    launch([str(WORKER), str(out), str(root)], timeout=180)
    return {
        "out": out,
        "root": root,
        "single_losses": single_losses,
        "ranks": [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)],
    }


def _load_single(root: Path, policy: str, resume: int | str) -> tuple[Any, ...]:
    """One process, no process group: the unwrapped model loads the 2-rank checkpoint."""
    cases.seed_everything(123)
    model, opt, prec = cases.build(policy)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = checkpoint.load(root, model=model, optimizer=opt, precision=prec, resume=resume)
    return model, opt, prec, loaded, [str(w.message) for w in caught]


def test_a_2_rank_fsdp_checkpoint_resumes_on_2_ranks_bitwise(ranks: dict[str, Any]) -> None:
    for rank in ranks["ranks"]:
        run, resumed = rank["run"], rank["resumed"]
        assert run["verified_step"] == cases.SAVE_AT
        assert resumed["losses"] == run["losses"][cases.SAVE_AT :]
        assert resumed["probe"] == run["probe"]  # each rank's own RNG streams
        assert resumed["warnings"] == []
        assert set(resumed["snapshot"]) == set(run["snapshot"])
        for key, value in run["snapshot"].items():
            assert torch.equal(_bits(value), _bits(resumed["snapshot"][key])), key
    probes = [rank["run"]["probe"] for rank in ranks["ranks"]]
    assert probes[0] != probes[1]  # the ranks' streams differ: restoring rank 0's would not do
    info = checkpoint.verify(ranks["root"] / "fsdp" / f"step_{cases.SAVE_AT:08d}")
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(info.files)
    assert (info.world_size, info.strategy) == (2, "sharded")


def test_a_2_rank_fsdp_checkpoint_loads_into_one_process(ranks: dict[str, Any]) -> None:
    run = ranks["ranks"][0]["run"]
    model, opt, prec, loaded, caught = _load_single(ranks["root"] / "fsdp", "bf16_master", 3)
    assert loaded["step"] == cases.SAVE_AT
    assert any("restart from rank 0's" in m for m in caught), caught
    assert cases.probe() == run["probe"]  # rank 0's streams
    losses = cases.train(model, opt, prec, cases.SAVE_AT, cases.STEPS)
    torch.testing.assert_close(losses, run["losses"][cases.SAVE_AT :], rtol=LOSS_RTOL, atol=0)


def test_a_one_process_checkpoint_loads_into_2_fsdp_ranks(ranks: dict[str, Any]) -> None:
    want = ranks["single_losses"][cases.SAVE_AT :]
    for rank in ranks["ranks"]:
        got = rank["from_single"]
        assert any("restart from rank 0's" in m for m in got["warnings"])
        torch.testing.assert_close(got["losses"], want, rtol=LOSS_RTOL, atol=0)


def test_a_corrupt_data_file_is_refused_on_both_ranks_alike(ranks: dict[str, Any]) -> None:
    errors = [rank["corrupt"]["error"] for rank in ranks["ranks"]]
    assert errors[0] is not None and errors[0] == errors[1]
    assert "__1_0.distcp: corrupt" in errors[0]


def test_a_save_one_rank_cannot_do_is_refused_on_both_and_keeps_latest(
    ranks: dict[str, Any],
) -> None:
    results = [rank["refused"] for rank in ranks["ranks"]]
    assert results[0]["error"] is not None and results[0]["error"] == results[1]["error"]
    assert results[0]["error"].startswith("rank 1: cannot save extra/bad")
    assert results[0]["latest"] == results[1]["latest"] == cases.STEPS
    assert not (ranks["root"] / "fsdp" / "step_00000099").exists()


def test_export_from_2_ranks_equals_export_from_one_process(ranks: dict[str, Any]) -> None:
    from safetensors import safe_open

    assert [rank["run"]["export_written"] for rank in ranks["ranks"]] == [True, False]
    model, opt, prec, _, _ = _load_single(ranks["root"] / "fsdp", "bf16_master", cases.STEPS)
    one = ranks["out"] / "export1.safetensors"
    checkpoint.export(model, opt, one, "fp32", policy=prec.policy, step=cases.STEPS)
    two = ranks["out"] / "export2.safetensors"
    assert one.read_bytes() == two.read_bytes()  # the metadata keys sorted, not hash-ordered
    with safe_open(str(one), "pt") as a, safe_open(str(two), "pt") as b:
        assert a.metadata() == b.metadata()
        keys = sorted(a.keys())
        assert keys == sorted(b.keys())
        for key in keys:
            assert torch.equal(_bits(a.get_tensor(key)), _bits(b.get_tensor(key))), key


def test_a_2_rank_ddp_checkpoint_loads_into_one_process(ranks: dict[str, Any]) -> None:
    ddp = [rank["ddp"] for rank in ranks["ranks"]]
    info = checkpoint.verify(ranks["root"] / "ddp" / f"step_{cases.SAVE_AT:08d}")
    assert (info.world_size, info.strategy) == (2, "replicated")
    model, opt, prec, loaded, _ = _load_single(ranks["root"] / "ddp", "amp_bf16", "latest")
    assert loaded["step"] == cases.SAVE_AT
    state = model.state_dict()
    assert set(state) == set(ddp[0]["state"])  # DDP's "module." is not in the checkpoint
    for key, value in ddp[0]["state"].items():
        assert torch.equal(_bits(value), _bits(state[key])), key
    losses = cases.train(model, opt, prec, cases.SAVE_AT, cases.STEPS)
    torch.testing.assert_close(losses, ddp[0]["losses"][cases.SAVE_AT :], rtol=LOSS_RTOL, atol=0)


def test_a_ddp_export_has_the_module_keys(ranks: dict[str, Any]) -> None:
    from safetensors.torch import load_file

    ddp = [rank["ddp"] for rank in ranks["ranks"]]
    assert [d["export"].written for d in ddp] == [True, False]
    exported = load_file(str(ranks["out"] / "ddp.safetensors"))
    assert set(exported) == set(ddp[0]["state"])  # no "module." prefix
    for key, value in ddp[0]["state"].items():  # amp_bf16: fp32 params are the masters
        assert torch.equal(_bits(value), _bits(exported[key])), key
