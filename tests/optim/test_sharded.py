"""AdamW on FSDP2-style DTensor shards: sharded state, bitwise equal to unsharded, DCP round trip.

Two gloo processes on CPU run `sharded_worker.py`; this process runs the same
cases on plain tensors and compares the gathered results bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ranks import launch

from . import sharded_cases as cases

WORKER = Path(__file__).with_name("sharded_worker.py")


@pytest.fixture(scope="module")
def sharded_results(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple, dict]:
    tmp = tmp_path_factory.mktemp("sharded")
    out, ckpt = tmp / "results.pt", tmp / "ckpt"
    launch([str(WORKER), str(out), str(ckpt)])
    results: dict[object, dict] = torch.load(out, weights_only=True)
    results["checkpoints"] = {"root": ckpt}
    return results


def _reference(case: tuple[str, str, bool]) -> dict[str, list]:
    params = [p.requires_grad_() for p in cases.full_params(case)]
    opt = cases.make_optimizer(case, params)
    for step in range(cases.STEPS):
        for p, g in zip(params, cases.full_grads(case, step), strict=True):
            p.grad = g
        opt.step()
    return {
        "params": [p.detach() for p in params],
        "masters": opt.master_weights(),
        "state": [dict(opt.state[p]) for p in params],
        "formats": opt.formats(),
    }


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
    )


@pytest.mark.slow
@pytest.mark.parametrize("case", cases.CASES, ids=lambda c: f"{c[0]}-{c[1]}-fused{int(c[2])}")
def test_sharded_steps_equal_unsharded_bitwise_through_a_dcp_reload(
    sharded_results: dict[tuple, dict], case: tuple[str, str, bool]
) -> None:
    got, want = sharded_results[case], _reference(case)
    assert got["state_types"] == ["DTensor"]  # every non-scalar state tensor is sharded
    assert got["formats"] == want["formats"]
    if case[1] == "int8":  # the 1-D and tiny params keep fp32 moments (sharded or not)
        assert [m for _, m in got["formats"]] == ["int8", "int8", "int8", "fp32", "fp32", "int8"]
    if case[1] == "int4":  # rows of whole 128-blocks only (8 x 64: int8's rule decides)
        assert [m for _, m in got["formats"]] == ["int4", "int4", "int8", "fp32", "fp32", "int4"]
    for a, b in zip(got["params"], want["params"], strict=True):
        assert _same_bits(a, b)
    for a, b in zip(got["masters"], want["masters"], strict=True):
        assert _same_bits(a, b)
    for got_state, want_state in zip(got["state"], want["state"], strict=True):
        assert set(got_state) == set(want_state)
        for key, value in want_state.items():
            assert _same_bits(got_state[key], value), key


@pytest.mark.slow
def test_fully_shard_training_equals_single_process_bitwise(
    sharded_results: dict[object, dict],
) -> None:
    got = sharded_results["fsdp"]
    model = cases.fsdp_model()
    opt = cases.fsdp_optimizer(list(model.parameters()))
    losses = cases.fsdp_train(model, opt, cases.STEPS)
    assert got["losses"] == losses
    assert losses[-1] < losses[0]
    assert set(got["backends"].values()) == {"native"}  # local shards on the native kernel
    for a, b in zip(got["params"], model.parameters(), strict=True):
        assert _same_bits(a, b.detach())


@pytest.mark.slow
@pytest.mark.parametrize("case", cases.INT4_CASES, ids=lambda c: f"{c[0]}-fused{int(c[2])}")
def test_an_int4_checkpoint_saved_on_2_ranks_resumes_in_one_process_bitwise(
    sharded_results: dict[object, dict], case: tuple[str, str, bool]
) -> None:
    # What int4 stores does not depend on the sharding (column maxima are reduced over
    # the ranks), so the 2-rank checkpoint of step SAVE_AT goes on in one process
    # exactly as an unsharded run does.
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = cases.Holder([torch.nn.Parameter(torch.zeros_like(p)) for p in cases.full_params(case)])
    opt = cases.make_optimizer(case, list(model.ps))
    msd, osd = get_state_dict(model, opt)
    loaded = {"model": msd, "optim": osd}
    root = sharded_results["checkpoints"]["root"]
    dcp.load(loaded, checkpoint_id=root / str(cases.CASES.index(case)))
    # The weights before the optimizer: torch's set_state_dict loads them after it, an
    # in-place edit after which a master restarts from the weights (docs/optim.md).
    model.load_state_dict(loaded["model"])
    set_state_dict(model, opt, model_state_dict={}, optim_state_dict=loaded["optim"])
    for step in range(cases.SAVE_AT, cases.STEPS):
        for p, g in zip(model.ps, cases.full_grads(case, step), strict=True):
            p.grad = g
        opt.step()
    want = _reference(case)
    for a, b in zip(model.ps, want["params"], strict=True):
        assert _same_bits(a.detach(), b)
    for p, want_state in zip(model.ps, want["state"], strict=True):
        for key, value in want_state.items():
            assert _same_bits(opt.state[p][key], value), key


@pytest.mark.slow
def test_int8_blocks_straddling_shards_fall_back_to_fp32_moments(
    sharded_results: dict[object, dict],
) -> None:
    plain = cases.make_optimizer(
        cases.CASES[0], [torch.zeros(cases.UNALIGNED_SHAPE, dtype=torch.bfloat16)]
    )
    assert plain.formats() == [("exact", "int8")]
    assert sharded_results["unaligned_formats"] == [("exact", "fp32")]


@pytest.mark.parametrize("n", [0, 1, 5, 7, 8, 33])
@pytest.mark.parametrize("parts", [1, 2, 3, 4])
def test_row_split_follows_torch_chunk(n: int, parts: int) -> None:
    # DTensor's Shard(0) splits rows as torch.chunk does, with empty trailing shards.
    from mixprec.optim.sharding import _chunks

    sizes = [c.numel() for c in torch.arange(n).chunk(parts)] if n else []
    sizes += [0] * (parts - len(sizes))
    assert [size for _, size in _chunks(n, parts)] == sizes
    starts = [start for start, size in _chunks(n, parts) if size]
    assert starts == [sum(sizes[:i]) for i in range(parts) if sizes[i]]
