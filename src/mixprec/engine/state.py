"""`Precision`'s saved state: the policy it ran under, the scaler's and the telemetry's.

`parse_state` validates everything before anything changes, so a bad state
leaves the `Precision` that loads it as it was.
"""

from __future__ import annotations

from typing import Any

import torch

from mixprec.policy import Policy
from mixprec.telemetry import PrecisionStats, check_scaler_state

__all__ = ["parse_state", "precision_state"]


def precision_state(
    policy: Policy, scaler: torch.amp.GradScaler, stats: PrecisionStats
) -> dict[str, Any]:
    """The state `Precision.state_dict` returns (plain data and tensors)."""
    return {
        "policy": policy.to_dict(),
        "scaler": scaler.state_dict(),
        "stats": stats.to_dict(),
    }


def parse_state(
    state: dict[str, Any], *, policy: Policy, strict: bool
) -> tuple[dict[str, Any] | None, PrecisionStats]:
    """Validate `precision_state` output for a run under `policy`.

    Returns:
        The scaler state to load (None when there is none, or the policy does not
        scale the loss) and the telemetry.

    Raises:
        ValueError: a state that is not `precision_state` output (missing keys, a
            loss scale that is not a finite number > 0, malformed telemetry), or a
            different policy under `strict`.
    """
    if not isinstance(state, dict):
        raise ValueError(
            f"Precision state must be a dict from Precision.state_dict(), got "
            f"{type(state).__name__}"
        )
    missing = [k for k in ("policy", "scaler", "stats") if k not in state]
    if missing:
        raise ValueError(
            f"Precision state is missing {missing}; expected Precision.state_dict() output"
        )
    saved = state["policy"]
    if not isinstance(saved, dict):
        raise ValueError(f"Precision state 'policy' must be a dict, got {saved!r}")
    if strict:
        diff = policy.differences(saved)
        if diff:
            raise ValueError(
                f"state was saved under a different policy (fields {sorted(diff)} differ: "
                f"saved { {k: a for k, (a, _) in diff.items()} }, now "
                f"{ {k: b for k, (_, b) in diff.items()} }); "
                "pass strict=False to resume under the new policy deliberately"
            )
    scaler_state = state["scaler"]
    if not isinstance(scaler_state, dict):
        raise ValueError(f"Precision state 'scaler' must be a dict, got {scaler_state!r}")
    to_load = scaler_state if scaler_state and policy.scales_loss else None
    if to_load is not None:
        check_scaler_state(to_load)
    raw_stats = state["stats"]
    if not isinstance(raw_stats, dict):
        raise ValueError(f"Precision state 'stats' must be a dict, got {raw_stats!r}")
    return to_load, PrecisionStats.from_dict(raw_stats)
