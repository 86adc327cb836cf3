"""`mixprec.floats`: format facts from bit layouts, checked against torch, with no torch import."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import mixprec.floats as floats
from mixprec.dtypes import parse_dtype

#: Every format mixprec names (canonical names), from the spelling table.
ALL_FORMATS = sorted(set(floats.SPELLINGS.values()))

#: Where torch.finfo is wrong and the layout is right, with the proof in the test below:
#: torch 2.13 reports eps 0.125 for float8_e5m2fnuz, a format with 2 mantissa bits.
FINFO_MISTAKES = {("fp8_e5m2fnuz", "eps"), ("fp8_e5m2fnuz", "smallest_subnormal")}


@pytest.mark.parametrize("name", ALL_FORMATS)
def test_layout_facts_equal_torch_finfo(name: str) -> None:
    info = floats.float_format(name)
    fi = torch.finfo(getattr(torch, info.torch_name))
    torch_facts = {
        "bits": fi.bits,
        "eps": float(fi.eps),
        "smallest_normal": float(fi.smallest_normal),
        "smallest_subnormal": float(fi.smallest_normal) * float(fi.eps),
        "max": float(fi.max),
    }
    for fact, expected in torch_facts.items():
        if (name, fact) not in FINFO_MISTAKES:
            assert getattr(info, fact) == expected, (name, fact)
    assert info.bits == 1 + info.exponent_bits + info.mantissa_bits
    assert info.dtype is parse_dtype(name)


@pytest.mark.parametrize("name", ALL_FORMATS)
def test_eps_and_max_hold_for_real_rounding(name: str) -> None:
    """The facts as torch's casts realize them: 1 + eps is the next value after 1, half
    of it ties back to 1, the maximum round-trips and its next step does not exist."""
    info = floats.float_format(name)
    dtype = parse_dtype(name)
    x = torch.tensor([1.0 + info.eps, 1.0 + info.eps / 4, info.max], dtype=torch.float64)
    back = x.to(dtype).to(torch.float64).tolist()
    assert back == [1.0 + info.eps, 1.0, info.max]
    tiny = torch.tensor([info.smallest_subnormal], dtype=torch.float64)
    assert tiny.to(dtype).to(torch.float64).item() == info.smallest_subnormal
    assert (tiny / 4).to(dtype).to(torch.float64).item() == 0.0


def test_spellings_agree_with_parse_dtype() -> None:
    for spelling, name in floats.SPELLINGS.items():
        assert parse_dtype(spelling) is parse_dtype(name), spelling
        assert floats.canonical_name(parse_dtype(spelling)) == name
    assert floats.canonical_name(" Torch.BFloat16 ") == "bf16"
    with pytest.raises(ValueError, match=r"unsupported dtype torch\.int8"):
        floats.canonical_name(torch.int8)
    with pytest.raises(ValueError, match="valid spellings"):
        floats.canonical_name("bf17")
    with pytest.raises(TypeError, match=r"expected a torch\.dtype or a string"):
        floats.canonical_name(16)


def test_itemsizes_equal_torch() -> None:
    for name in [*ALL_FORMATS, "int8", "uint8", "int16", "int32", "int64"]:
        assert floats.itemsize(name) == getattr(torch, floats.torch_name(name)).itemsize, name


def test_format_names_load_no_torch() -> None:
    """The plain-data layers (format facts, the format registry with every built-in
    format's spec) never import torch: the doctor's static checks are built on them."""
    script = textwrap.dedent(
        """
        import sys
        import mixprec.floats
        from mixprec.formats import registry
        assert registry.master_spec("exact").bytes_per_element == 2
        assert registry.moment_spec("int8").blockwise
        print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
        """
    )
    src = str(Path(floats.__file__).parent.parent)
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": src, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
