"""The report's plots: PNGs by key, and matplotlib loaded only when one is drawn."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from mixprec.experiment.report import plots

from .judged import Judged

pytestmark = pytest.mark.plots  # draws the plots for real (see tests/conftest.py)

PNG = b"\x89PNG\r\n\x1a\n"


def test_importing_the_experiment_does_not_load_matplotlib() -> None:
    code = (
        "import sys, mixprec.experiment, mixprec.experiment.report.plots; "
        "print('matplotlib' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_draw_makes_a_png_per_key(judged: Judged) -> None:
    keys = [k for k in plots.PLOT_KEYS if k != "fp8"]  # no FP8 run here: test_fp8_report
    images = plots.draw(keys, judged.records, judged.decision, gap_limit=0.005)
    assert list(images) == keys
    assert all(png.startswith(PNG) and len(png) > 1000 for png in images.values())


def test_draw_refuses_what_it_cannot_draw(judged: Judged) -> None:
    with pytest.raises(ValueError, match="unknown plot 'nope'; valid plots"):
        plots.draw(["nope"], judged.records, judged.decision, gap_limit=0.005)
    unscaled = [dataclasses.replace(r, loss_scale_trace=()) for r in judged.records]
    with pytest.raises(ValueError, match="no run's loss scale moved"):
        plots.draw(["loss_scale"], unscaled, judged.decision, gap_limit=0.005)


def test_every_preset_has_its_own_colour_in_every_report() -> None:
    from mixprec.policy import PRESET_NAMES

    colours = [plots.policy_color(p) for p in PRESET_NAMES]
    assert len(set(colours)) == len(colours)
    # A name outside the presets gets a colour from its name alone, the same every time.
    assert plots.policy_color("my_policy") == plots.policy_color("my_policy")
    assert plots.policy_color("my_policy") not in plots.POLICY_COLORS.values()


def test_smoothing_decays_per_step_so_downsampled_curves_compare() -> None:
    """A 500-step curve is stored every other step; smoothed per point it lagged twice
    as many steps as a capped 100-step one and looked worse early on."""
    full = [[float(s), 1.0 if s < 10 else 0.0] for s in range(100)]
    every_other = full[::2]
    smooth_full = dict(zip([p[0] for p in full], plots._ema(full), strict=True))
    smooth_half = dict(zip([p[0] for p in every_other], plots._ema(every_other), strict=True))
    for step in (20.0, 40.0, 60.0):
        assert smooth_half[step] == pytest.approx(smooth_full[step], rel=0.25)
    assert smooth_full[20.0] == pytest.approx(0.9**11, rel=1e-9)
