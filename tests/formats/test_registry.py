"""The format registry: one spec per format, every other table derived from it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import mixprec.formats as formats
from mixprec.dtypes import parse_dtype
from mixprec.formats import MasterSpec, StateTensor
from mixprec.formats.masters import NoMaster
from mixprec.formats.registry import _MASTERS
from mixprec.formats.spec import ADAM_MOMENTS
from mixprec.optim import native
from mixprec.optim.kernels import StepFamily
from mixprec.optim.rules import RULES

try:
    LIBRARY: native.NativeLibrary | None = native.library()
    WHY = ""
except native.NativeUnavailableError as exc:
    LIBRARY, WHY = None, str(exc)
needs_native = pytest.mark.skipif(LIBRARY is None, reason=f"native kernel unavailable: {WHY}")


def _test_master(**fields: object) -> NoMaster:
    """A master format for tests: `NoMaster`'s encoding under a spec of the given fields."""
    spec = MasterSpec(
        **{
            "summary": "test",
            "state": (),
            "param_dtypes": (torch.bfloat16,),
            "exact": False,
            "keeps_small_updates": False,
            **fields,
        }  # type: ignore[arg-type]
    )
    return type(f"{spec.name}_format", (NoMaster,), {"spec": spec})()  # type: ignore[no-any-return]


def test_the_kernel_is_built_with_the_registrys_codes() -> None:
    """The registry is the one source of the kernel's codes: the build defines each
    C++ enum value from a spec's kernel_code (the C++ source is never parsed)."""
    defines = native.build.format_defines()
    for kind, specs in (("MASTER", formats.master_specs()), ("MOMENTS", formats.moment_specs())):
        for spec in specs:
            define = f"-DMIXPREC_{kind}_{spec.name.upper()}="
            if spec.kernel_code is None:  # no native case: no define at all
                assert not any(d.startswith(define) for d in defines)
            else:
                assert f"{define}{spec.kernel_code}" in defines
    if LIBRARY is not None:
        assert set(defines) <= set(LIBRARY.info.flags)


def _family(master: str, moments: str = "fp32") -> StepFamily:
    return StepFamily(
        RULES["adamw"],
        formats.master_format(master),
        formats.moment_format(moments, block_size=256),
        maximize=False,
    )


@needs_native
def test_the_kernel_covers_every_builtin_pair_with_a_code() -> None:
    assert LIBRARY is not None
    for master in formats.MASTER_KINDS:
        for moments in formats.MOMENT_KINDS:
            coded = formats.moment_spec(moments).kernel_code is not None
            assert LIBRARY.covers(_family(master, moments)) == coded, (master, moments)


def test_the_cache_key_changes_with_the_format_codes() -> None:
    """The defines are part of the key: a library built with other codes is not loaded."""
    key = native.build.cache_key("c++", native.build.flag_sets())
    formats.register_master(_test_master(name="bogus_test", kernel_code=42))
    try:
        assert "-DMIXPREC_MASTER_BOGUS_TEST=42" in native.build.format_defines()
        assert native.build.cache_key("c++", native.build.flag_sets()) != key
    finally:
        del _MASTERS["bogus_test"]
    assert native.build.cache_key("c++", native.build.flag_sets()) == key


def test_the_cache_key_covers_every_format_header_the_kernel_includes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The masters' codecs (formats/masters/<name>.h) are compiled into the kernel: each
    one it includes is hashed into the cache key, and a changed one changes the key."""
    source = native.SOURCE.read_text(encoding="utf-8")
    included = {
        (native.SOURCE.parent / line.split('"')[1]).resolve()
        for line in source.splitlines()
        if line.startswith('#include "')
    }
    assert included == {p.resolve() for p in native.build.FORMAT_HEADERS}
    header = tmp_path / "exact.h"
    header.write_text("// one\n")
    monkeypatch.setattr(native.build, "FORMAT_HEADERS", (header,))
    key = native.build.cache_key("c++", native.build.FLAG_SETS)
    header.write_text("// two\n")
    assert native.build.cache_key("c++", native.build.FLAG_SETS) != key


@needs_native
def test_a_kernel_code_the_cpp_source_lacks_is_never_sent_to_the_kernel() -> None:
    """Found by the second review: a format registered with kernel_code=42 was sent to
    the native kernel, which refused the step at run time."""
    assert LIBRARY is not None
    bogus = _test_master(name="bogus_test", kernel_code=42)

    formats.register_master(bogus)
    try:
        b16 = torch.zeros(256, dtype=torch.bfloat16)
        assert not LIBRARY.supports(_family("bogus_test"), param=b16, grad=b16, block_size=256)
    finally:
        del _MASTERS["bogus_test"]


def test_register_moments_needs_a_builder() -> None:
    spec = formats.moment_spec("fp32")
    odd = dataclasses.replace(spec, name="odd_test", kernel_code=None)
    with pytest.raises(TypeError, match="build must take the block size"):
        formats.register_moments(odd, None)  # type: ignore[arg-type]


def test_state_keys_and_bytes_come_from_the_declared_tensors() -> None:
    fmt = formats.master_format("exact")
    state = fmt.init_state(torch.zeros(3, 5, dtype=torch.bfloat16))
    assert tuple(state) == fmt.spec.state_keys
    assert sum(t.element_size() for t in state.values()) == fmt.spec.bytes_per_element
    for spec in formats.master_specs():
        param = torch.zeros(64, dtype=parse_dtype((spec.param_dtypes or ("bf16",))[0]))
        made = formats.master_format(spec.name).init_state(param)
        assert tuple(made) == spec.state_keys, spec.name
        assert sum(t.nbytes for t in made.values()) == spec.nbytes(64), spec.name
        assert [t.dtype for t in made.values()] == [s.torch_dtype for s in spec.state], spec.name
    for mspec in formats.moment_specs():
        fmt_m = formats.moment_format(mspec.name, block_size=16)
        made = fmt_m.init_state(torch.zeros(8, 128), ADAM_MOMENTS)  # (int4: rows of whole blocks)
        assert tuple(made) == mspec.state_keys, mspec.name
        assert sum(t.nbytes for t in made.values()) == mspec.nbytes(1024, block_size=16, rows=8)


def test_unknown_names_list_the_registered_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown master 'fp64'; valid: none, fp32, exact"):
        formats.check_master("fp64")
    with pytest.raises(ValueError, match=r"unknown moments 'fp8'; valid: fp32, bf16, int8"):
        formats.moment_spec("fp8")


def test_duplicate_names_and_kernel_codes_are_refused() -> None:
    with pytest.raises(ValueError, match="already registered"):
        formats.register_master(NoMaster())

    clash = _test_master(name="clash", param_dtypes=None, kernel_code=2)

    with pytest.raises(ValueError, match="kernel code 2 is already taken"):
        formats.register_master(clash)


def test_a_new_format_is_one_registration_and_never_reaches_the_native_kernel() -> None:
    copy16 = _test_master(
        name="copy16_test",
        summary="a bf16 copy (test only)",
        state=(StateTensor("copy16", torch.bfloat16),),
    )

    formats.register_master(copy16)
    try:
        assert formats.master_spec("copy16_test").bytes_per_element == 2
        assert "copy16" in formats.master_state_keys()
        b16 = torch.zeros(256, dtype=torch.bfloat16)
        if LIBRARY is not None:
            supports = LIBRARY.supports
            assert not supports(_family("copy16_test"), param=b16, grad=b16, block_size=256)
            assert supports(_family("exact"), param=b16, grad=b16, block_size=256)
    finally:
        del _MASTERS["copy16_test"]


@pytest.mark.parametrize(
    ("kwargs", "kind", "words"),
    [
        ({"name": "auto"}, ValueError, "other than 'auto'"),
        ({"name": ""}, ValueError, "lowercase identifier"),
        ({"name": 5}, ValueError, "lowercase identifier"),
        ({"state": (StateTensor("step", torch.int8),)}, ValueError, "reserved"),
        ({"state": (StateTensor("a", "int7"),)}, TypeError, "must name a storage dtype"),
        ({"kernel_code": -1}, ValueError, "kernel_code must be an int >= 0"),
        ({"param_dtypes": ("bf17",)}, TypeError, "param_dtypes"),
        ({"param_dtypes": (torch.int8,)}, TypeError, "floating"),
        ({"exact": "yes"}, TypeError, "exact must be True or False"),
    ],
)
def test_specs_that_would_damage_the_registry_are_refused(
    kwargs: dict[str, object], kind: type[Exception], words: str
) -> None:
    """Found by review: 'auto', '' and 5 were accepted as names, and a non-string name
    turned every later 'unknown master' message into a TypeError."""
    with pytest.raises(kind, match=words):
        _test_master(**{"name": "probe_test", "param_dtypes": None, **kwargs})


def test_a_master_state_key_may_not_shadow_a_moment_key() -> None:
    shadow = _test_master(name="shadow_test", state=(StateTensor("exp_avg", torch.bfloat16),))

    with pytest.raises(ValueError, match=r"state keys \['exp_avg'\] are already used"):
        formats.register_master(shadow)


def test_a_format_registered_later_is_usable_by_policy_and_optimizer_alike() -> None:
    """Found by review: Policy accepted a registered master that AdamW refused (AdamW
    checked a snapshot of the names taken at import)."""
    import mixprec
    from mixprec.optim import AdamW

    plain = _test_master(name="plain_test")

    formats.register_master(plain)
    try:
        pol = mixprec.Policy(
            compute_dtype=torch.bfloat16, param_dtype=torch.bfloat16, master="plain_test"
        )
        w = torch.nn.Parameter(torch.zeros(8, dtype=torch.bfloat16))
        opt = AdamW([w], master=pol.master)
        assert opt.format_of(w) == ("plain_test", "fp32")
    finally:
        del _MASTERS["plain_test"]
