"""``--track`` and ``--track-uri``: the flags `compare` and `train` share."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

__all__ = ["add_track_flags", "check_track", "tracker_from_args"]


def add_track_flags(p: argparse.ArgumentParser) -> None:
    """Register ``--track {mlflow,tensorboard}`` and ``--track-uri``."""
    p.add_argument(
        "--track",
        choices=("mlflow", "tensorboard"),
        default=None,
        help="also log params, per-step metrics, the outcome and the summary files to MLflow "
        "(pip install 'mixprec[mlflow]') or TensorBoard (pip install 'mixprec[tensorboard]')",
    )
    p.add_argument(
        "--track-uri",
        default=None,
        metavar="URI",
        help="MLflow tracking URI (default: MLFLOW_TRACKING_URI, else the file store "
        "./mlruns) or TensorBoard log dir (default: OUT/tensorboard)",
    )


def check_track(args: argparse.Namespace) -> None:
    """Refuse ``--track-uri`` without ``--track``, or a tracker whose package is missing
    (one line with the ``pip install``), before anything runs."""
    from mixprec.tracking import check_available

    if args.track is None:
        if args.track_uri is not None:
            raise ValueError("--track-uri needs --track mlflow or --track tensorboard")
        return
    if args.track_uri is not None and not args.track_uri.strip():
        raise ValueError(
            "--track-uri is empty: give a tracking URI or log dir, or leave it out for the default"
        )
    check_available(args.track)


def tracker_from_args(args: argparse.Namespace, out: Path) -> Any:
    """The tracker the flags name (a `mixprec.tracking.Tracker`), or None."""
    if args.track is None:
        return None
    from mixprec.tracking import open_tracker

    check_track(args)
    return open_tracker(args.track, out=out, uri=args.track_uri)
