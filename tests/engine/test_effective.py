"""Requested versus effective precision: refuse what the device cannot run, warn when slow."""

from __future__ import annotations

import importlib
import warnings

import pytest

from mixprec import Precision, PrecisionError
from mixprec.device import DeviceCaps
from mixprec.errors import PerformanceWarning

from .helpers import make_model

pytestmark = pytest.mark.usefixtures("quiet_expected_warnings")


def test_unsupported_compute_raises_instead_of_swapping(monkeypatch: pytest.MonkeyPatch) -> None:
    caps = DeviceCaps(
        device_type="cpu",
        name="old cpu",
        bf16_supported=False,
        fp16_supported=True,
        bf16_fast=False,
        fp16_fast=False,
        bf16_reason="no bf16 here",
        fp16_reason="slow",
    )
    monkeypatch.setattr(
        importlib.import_module("mixprec.engine.effective"), "device_caps", lambda device=None: caps
    )
    prec = Precision("amp_bf16", device="cpu")
    with pytest.raises(PrecisionError, match="old cpu cannot run: no bf16 here"):
        prec.autocast()
    with pytest.raises(PrecisionError, match="does not swap formats silently"):
        prec.prepare(make_model())


def test_fp16_on_cpu_without_fast_fp16_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    caps = DeviceCaps(
        device_type="cpu",
        name="this cpu",
        bf16_supported=True,
        fp16_supported=True,
        bf16_fast=True,
        fp16_fast=False,
        bf16_reason="fast",
        fp16_reason="emulated fp16",
    )
    monkeypatch.setattr(
        importlib.import_module("mixprec.engine.effective"), "device_caps", lambda device=None: caps
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", PerformanceWarning)
        with pytest.raises(PerformanceWarning, match="emulated fp16"):
            Precision("amp_fp16").prepare(make_model())
    desc = Precision("amp_fp16", device="cpu").describe()
    assert desc["compute_supported"] and not desc["compute_fast"]
