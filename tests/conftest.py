"""Shared test setup: a fixed, small thread count (2 cores here; oversubscription makes
small steps many times slower) and deterministic seeds."""

from __future__ import annotations

import os
import struct
import sys
import zlib
from collections.abc import Iterator

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _fresh_accelerate_state() -> Iterator[None]:
    """Accelerate keeps one state per process (``AcceleratorState``: mixed precision,
    device, accumulation), and a second ``Accelerator`` with other settings raises; each
    test that builds one (directly, or through the HF Trainer) starts from none."""
    yield
    state = sys.modules.get("accelerate.state")
    if state is not None:
        state.AcceleratorState._reset_state(reset_partial_state=True)
        state.GradientState._reset_state()


def _png_1x1() -> bytes:
    """A valid 1x1 black RGB PNG (the TensorBoard tracker decodes the plots it logs)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = struct.pack(">I", zlib.crc32(kind + data))
        return struct.pack(">I", len(data)) + kind + data + crc

    header = struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(b"\x00\x00\x00\x00"))
        + chunk(b"IEND", b"")
    )


@pytest.fixture
def stand_in_plots(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The report's plots drawn as a 1x1 PNG each, unless the test is marked ``plots``.

    matplotlib drew about 10 s of an 11 s tiny compare; the tests of compare, the CLI and
    the property tests check nothing about the pixels, so their directories use this
    fixture (autouse there). The report's files, names and embedded images are still
    written; the plots themselves are tested in tests/experiment/report (marked ``plots``).
    A fixture of a wider scope runs before this one: a report it writes draws for real.
    """
    if request.node.get_closest_marker("plots") is not None:
        return
    from mixprec.experiment.report import plots

    png = _png_1x1()
    monkeypatch.setattr(plots, "draw", lambda keys, *_args, **_kwargs: dict.fromkeys(keys, png))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
