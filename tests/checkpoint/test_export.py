"""`mixprec.checkpoint.export`: true weights from the master, dtype rules, atomic writes."""

from __future__ import annotations

import importlib
import json
import os
import stat
from pathlib import Path

import pytest
import torch
from torch import nn

import mixprec
import tolerances as tol
from hf_models import tiny_llama

safetensors_torch = pytest.importorskip("safetensors.torch")
load_file = safetensors_torch.load_file

export_module = importlib.import_module("mixprec.checkpoint.export")
export = export_module.export

LAYERNORM_KEYS = ("1.weight", "1.bias")


def make_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 4))


def train_mlp(
    preset: str = "bf16_master",
    steps: int = 5,
    *,
    export_at: int | None = None,
    to: Path | None = None,
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A few AdamW steps on random data; with `export_at`, export to `to` before that step."""
    prec = mixprec.Precision(preset)
    model = prec.prepare(make_mlp())
    opt = prec.optimizer(model, lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for i in range(steps):
        if i == export_at:
            export(model, opt, to, "bf16")
        x, y = torch.randn(32, 8, generator=g), torch.randn(32, 4, generator=g)
        with prec.autocast():
            loss = nn.functional.mse_loss(model(x).float(), y)
        prec.backward(loss)
        assert prec.step(opt).applied
        opt.zero_grad(set_to_none=True)
    return model, opt


def masters_by_key(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Parameter name (tied ones under each name) -> its fp32 master."""
    params = [p for group in opt.param_groups for p in group["params"]]
    by_id = {id(p): m for p, m in zip(params, opt.master_weights(), strict=True)}
    return {k: by_id[id(p)] for k, p in model.named_parameters(remove_duplicate=False)}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of `t`, so equality is bitwise (-0.0 != 0.0, NaN == same NaN)."""
    view = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
    return t.view(view[t.dtype]) if t.is_floating_point() else t


def assert_bitwise(a: torch.Tensor, b: torch.Tensor, key: str) -> None:
    assert a.dtype == b.dtype, (key, a.dtype, b.dtype)
    assert torch.equal(bits(a), bits(b)), key


# ------------------------------------------------------------------ values from the master


def test_fp32_export_is_the_exact_master_bitwise(tmp_path: Path) -> None:
    model, opt = train_mlp()
    info = export(model, opt, tmp_path / "m.safetensors")
    loaded = load_file(info.path)
    masters = masters_by_key(model, opt)
    assert loaded.keys() == masters.keys()
    for key, master in masters.items():
        assert_bitwise(loaded[key], master, key)
    # The master carried information the bf16 params lost.
    params = model.state_dict()
    lost = [k for k in masters if not torch.equal(loaded[k], params[k].float())]
    assert set(lost) >= {"0.weight", "3.weight"}
    assert info.from_master == len(masters) and info.tensors == len(masters)
    assert info.dtype == torch.float32 and info.islands == ()


def test_bf16_export_rounds_the_master_and_keeps_islands(tmp_path: Path) -> None:
    model, opt = train_mlp()
    masters = masters_by_key(model, opt)
    info = export(model, opt, tmp_path / "m.safetensors", "bf16")
    loaded = load_file(info.path)
    assert info.islands == LAYERNORM_KEYS
    for key, master in masters.items():
        expected = master if key in LAYERNORM_KEYS else master.to(torch.bfloat16)
        assert_bitwise(loaded[key], expected, key)

    cast = export(model, opt, tmp_path / "c.safetensors", torch.bfloat16, fp32_islands="cast")
    loaded = load_file(cast.path)
    assert cast.islands == ()
    for key, master in masters.items():
        assert_bitwise(loaded[key], master.to(torch.bfloat16), key)


def test_all_fp32_model_has_no_islands(tmp_path: Path) -> None:
    model, opt = train_mlp("fp32", steps=2)
    info = export(model, opt, tmp_path / "m.safetensors", "bf16")
    assert info.islands == ()
    loaded = load_file(info.path)
    assert {t.dtype for t in loaded.values()} == {torch.bfloat16}
    for key, value in model.state_dict().items():
        assert_bitwise(loaded[key], value.to(torch.bfloat16), key)


def test_export_mid_run_leaves_training_unchanged(tmp_path: Path) -> None:
    plain, plain_opt = train_mlp(steps=6)
    exported, exported_opt = train_mlp(steps=6, export_at=3, to=tmp_path / "m.safetensors")
    assert (tmp_path / "m.safetensors").exists()
    for key, master in masters_by_key(plain, plain_opt).items():
        assert_bitwise(masters_by_key(exported, exported_opt)[key], master, key)
    for key, value in plain.state_dict().items():
        assert_bitwise(exported.state_dict()[key], value, key)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("count", torch.tensor(3, dtype=torch.int64))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.emb(ids)))


def test_tied_weights_load_strict(tmp_path: Path) -> None:
    prec = mixprec.Precision("bf16_master")
    model = prec.prepare(Tied())
    opt = prec.optimizer(model, lr=1e-2)
    ids = torch.randint(0, 16, (4, 6))
    for _ in range(3):
        with prec.autocast():
            loss = nn.functional.cross_entropy(model(ids).float().flatten(0, 1), ids.flatten())
        prec.backward(loss)
        prec.step(opt)
        opt.zero_grad(set_to_none=True)
    info = export(model, opt, tmp_path / "tied.safetensors")
    loaded = load_file(info.path)
    assert {"emb.weight", "head.weight", "count"} <= loaded.keys()
    assert torch.equal(loaded["emb.weight"], loaded["head.weight"])
    assert loaded["count"].dtype == torch.int64 and loaded["count"].item() == 3
    fresh = Tied()
    fresh.load_state_dict(loaded, strict=True)
    assert fresh.head.weight is fresh.emb.weight
    assert_bitwise(fresh.emb.weight.detach(), masters_by_key(model, opt)["emb.weight"], "emb")


# ------------------------------------------------------------------ HuggingFace


@pytest.mark.parametrize("tie", [False, True])
def test_hf_llama_from_pretrained_gives_master_logits(tmp_path: Path, tie: bool) -> None:
    transformers = pytest.importorskip("transformers")
    fields = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64}
    prec = mixprec.Precision("bf16_master")
    model = prec.prepare(tiny_llama(**fields, tie_word_embeddings=tie))
    opt = prec.optimizer(model, lr=1e-2)
    ids = torch.randint(0, 64, (2, 16))
    for _ in range(3):
        with prec.autocast():
            loss = model(ids, labels=ids).loss
        prec.backward(loss)
        assert prec.step(opt).applied
        opt.zero_grad(set_to_none=True)

    info = export(model, opt, tmp_path, policy=prec.policy, step=3)
    assert info.path == tmp_path / "model.safetensors"
    assert info.config_path == tmp_path / "config.json"
    on_disk = json.loads(info.config_path.read_text())
    assert on_disk["dtype"] == "float32" and on_disk["architectures"] == ["LlamaForCausalLM"]
    assert model.config.architectures is None  # the model's own config is left alone

    reloaded, loading = transformers.LlamaForCausalLM.from_pretrained(
        tmp_path, output_loading_info=True
    )
    assert reloaded.dtype == torch.float32
    assert not loading["missing_keys"] and not loading["unexpected_keys"], loading
    assert (reloaded.lm_head.weight is reloaded.model.embed_tokens.weight) == tie

    # The reference: an fp32 model holding the masters, run in fp32.
    reference = tiny_llama(**fields, tie_word_embeddings=tie)
    masters = masters_by_key(model, opt)
    reference.load_state_dict(masters, strict=True)
    for module in (reloaded, reference, model):
        module.eval()
    with torch.no_grad():
        logits = reloaded(ids).logits
        expected = reference(ids).logits
        with prec.autocast():
            trained = model(ids).logits.float()
    assert torch.equal(logits, expected)
    # The trained model under its policy (bf16 weights and compute) is close, not equal.
    gap = (logits - trained).abs().max().item()
    assert 0 < gap <= tol.EXPORT_POLICY_LOGITS_ATOL


# ------------------------------------------------------------------ errors and atomicity


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        ("fp8_e4m3", ValueError),
        ("float64", ValueError),
        ("int4", ValueError),
        (torch.float64, ValueError),
        (torch.int8, ValueError),
        (16, TypeError),
    ],
)
def test_bad_dtype_is_refused_naming_it(tmp_path: Path, bad: object, error: type) -> None:
    with pytest.raises(error, match=r"export dtype .* valid choices: 'fp32', 'bf16', 'fp16'") as e:
        export(make_mlp(), None, tmp_path / "m.safetensors", bad)  # type: ignore[arg-type]
    assert repr(bad) in str(e.value)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("spelling", ["bf16", "BF16", "bfloat16", torch.bfloat16])
def test_dtype_spellings(tmp_path: Path, spelling: object) -> None:
    info = export(make_mlp(), None, tmp_path / "m.safetensors", spelling)  # type: ignore[arg-type]
    assert info.dtype == torch.bfloat16
    assert {t.dtype for t in load_file(info.path).values()} == {torch.bfloat16}


def test_bad_islands_choice_and_reserved_metadata(tmp_path: Path) -> None:
    model = make_mlp()
    with pytest.raises(ValueError, match="fp32_islands='drop'; valid choices: 'keep', 'cast'"):
        export(model, None, tmp_path / "m.safetensors", fp32_islands="drop")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"reuses keys export writes itself: \['dtype'\]"):
        export(model, None, tmp_path / "m.safetensors", extra_metadata={"dtype": "x"})
    with pytest.raises(TypeError, match="str to str"):
        export(model, None, tmp_path / "m.safetensors", extra_metadata={"run": 3})  # type: ignore[dict-item]
    assert not list(tmp_path.iterdir())


def test_fp16_overflow_is_refused_and_the_old_file_is_kept(tmp_path: Path) -> None:
    model = make_mlp()
    target = tmp_path / "m.safetensors"
    export(model, None, target, "fp16")
    before = target.read_bytes()
    with torch.no_grad():
        model[3].bias[1] = -1e5
    with pytest.raises(ValueError, match=r"tensor '3.bias' overflows fp16: max \|value\| 100000"):
        export(model, None, target, "fp16")
    assert target.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["m.safetensors"]  # no temporary left
    with pytest.raises(ValueError, match="overflows fp16"):
        export(model, None, tmp_path / "new_dir", "fp16")
    assert [p.name for p in tmp_path.iterdir()] == ["m.safetensors"]  # nothing created
    # bf16 and fp32 hold the value; the old file is replaced on success.
    info = export(model, None, target, "bf16")
    assert load_file(target)["3.bias"][1].item() == -99840.0  # 1e5 rounded to bf16
    assert target.read_bytes() != before and info.bytes == target.stat().st_size


def test_failed_write_leaves_the_target_untouched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = make_mlp()
    target = tmp_path / "m.safetensors"
    target.write_bytes(b"old")

    def half_write(tensors: object, filename: Path, metadata: object = None) -> None:
        Path(filename).write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(safetensors_torch, "save_file", half_write)
    with pytest.raises(OSError, match="disk full"):
        export(model, None, target)
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["m.safetensors"]


def test_existing_file_without_suffix_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "weights.bin"
    target.write_bytes(b"old")
    with pytest.raises(ValueError, match=r"does not end in '\.safetensors'"):
        export(make_mlp(), None, target)
    assert target.read_bytes() == b"old"


# ------------------------------------------------------------------ model values, metadata


@pytest.mark.parametrize("kind", ["none", "torch"])
def test_without_masters_the_model_values_are_written(tmp_path: Path, kind: str) -> None:
    model = make_mlp()
    opt = None if kind == "none" else torch.optim.AdamW(model.parameters(), lr=1e-2)
    if opt is not None:
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
    info = export(model, opt, tmp_path)  # a directory: model.safetensors inside, no config
    assert info.path == tmp_path / "model.safetensors" and info.config_path is None
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]
    loaded = load_file(info.path)
    for key, value in model.state_dict().items():
        assert_bitwise(loaded[key], value, key)
    assert info.from_master == 0
    with safetensors_torch.safe_open(info.path, "pt") as f:
        assert f.metadata()["source"] == "model"


def test_frozen_params_and_buffers_come_from_the_model(tmp_path: Path) -> None:
    prec = mixprec.Precision("bf16_master")
    model = prec.prepare(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)))
    model[2].requires_grad_(False)
    opt = prec.optimizer([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model(torch.randn(8, 4, dtype=torch.bfloat16)).float().sum().backward()
    prec.step(opt)
    info = export(model, opt, tmp_path / "m.safetensors", policy=prec.policy, step=7)
    loaded = load_file(info.path)
    trained = ["0.weight", "0.bias", "1.weight", "1.bias"]
    masters = dict(zip(trained, opt.master_weights(), strict=True))
    for key, value in model.state_dict().items():
        expected = masters[key] if key in masters else value.float()
        if not value.is_floating_point():
            expected = value
        assert_bitwise(loaded[key], expected, key)
    assert info.from_master == 4
    with safetensors_torch.safe_open(info.path, "pt") as f:
        meta = f.metadata()
    assert meta["format"] == "pt" and meta["dtype"] == "fp32" and meta["step"] == "7"
    assert meta["source"] == "mixed"
    assert json.loads(meta["model_params"]) == ["2.weight", "2.bias"]
    assert mixprec.Policy.from_dict(json.loads(meta["policy"])) == prec.policy
    assert meta["mixprec_version"] == mixprec.__version__


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_exported_files_get_the_mode_of_an_ordinary_new_file(tmp_path: Path, umask: int) -> None:
    old = os.umask(umask)
    try:
        (tmp_path / "plain").write_bytes(b"")
        file_info = export(make_mlp(), None, tmp_path / "m.safetensors")
        dir_info = export(make_mlp(), None, tmp_path / "out")
    finally:
        os.umask(old)
    expected = 0o666 & ~umask
    assert stat.S_IMODE((tmp_path / "plain").stat().st_mode) == expected
    for path in (file_info.path, dir_info.path):
        assert stat.S_IMODE(path.stat().st_mode) == expected, (path, oct(expected))


class _Pair(nn.Module):
    """Two linear layers registered in the order given (same names, same values)."""

    def __init__(self, order: tuple[str, str]) -> None:
        super().__init__()
        torch.manual_seed(0)
        layers = {"enc": nn.Linear(4, 3), "dec": nn.Linear(3, 2)}
        for name in order:
            setattr(self, name, layers[name])


def test_exports_of_equal_tensors_are_byte_identical(tmp_path: Path) -> None:
    a, b = _Pair(("enc", "dec")), _Pair(("dec", "enc"))
    assert list(a.state_dict()) != list(b.state_dict())
    meta = {"run": "r1", "note": "tab\there, \u00e9, \x01"}
    prec = mixprec.Precision("bf16_master")
    first = export(
        a, None, tmp_path / "a.safetensors", policy=prec.policy, step=3, extra_metadata=meta
    )
    second = export(
        b,
        None,
        tmp_path / "b.safetensors",
        policy=prec.policy,
        step=3,
        extra_metadata=dict(reversed(meta.items())),
    )
    assert first.path.read_bytes() == second.path.read_bytes()
    with safetensors_torch.safe_open(first.path, "pt") as f:
        assert f.metadata()["note"] == meta["note"]
    # Metadata is a hash map inside safetensors: its order must not leak into the bytes.
    for i in range(4):
        again = export(
            a,
            None,
            tmp_path / f"again{i}.safetensors",
            policy=prec.policy,
            step=3,
            extra_metadata=meta,
        )
        assert again.path.read_bytes() == first.path.read_bytes()
