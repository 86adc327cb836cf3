"""Resuming a `train` run: which checkpoint, and whether it belongs to this run.

A checkpoint of `train` carries, in its ``extra``, what makes the run repeatable
(`run_state`): the data position (the seed and the step: a built-in workload draws
batch ``k`` from them alone), the workload and its config, the training settings,
the optimizer and the recipe. A resume takes the checkpoint `resume_point` names and
refuses one of another policy or optimizer class (`check_trained_as`, before
anything is loaded) or of another run (`check_run`,
naming every field that differs, the optimizer's arguments included).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mixprec.policy import Policy

# `mixprec.checkpoint` is imported when a run resumes: compare (`import mixprec.experiment`)
# needs no torch.distributed.checkpoint.
if TYPE_CHECKING:
    from mixprec.checkpoint import CheckpointInfo
    from mixprec.experiment.recipe import Recipe
    from mixprec.workloads.settings import TrainSettings

__all__ = [
    "RESUME",
    "check_run",
    "check_trained_as",
    "resume_point",
    "run_state",
]

#: What `train(resume=)` takes besides None.
RESUME = ("latest", "latest-valid")

#: How a checkpoint of several ranks was saved (`CheckpointInfo.strategy`), as the flag
#: that saves it so.
_STRATEGY_FLAG = {"sharded": " --strategy fsdp2", "replicated": " --strategy ddp"}


def resume_point(
    root: Path, out: Path, resume: str | None, *, world: int, ranks_as_saved: bool
) -> CheckpointInfo | None:
    """The verified checkpoint under `root` a run in `out` goes on from; None for a new run.

    Raises:
        ValueError: a new run in a folder that holds checkpoints, a resume without
            any, or (`ranks_as_saved`) one saved by another number of ranks.
            A damaged checkpoint raises `mixprec.checkpoint.CheckpointError`.
    """
    from mixprec.checkpoint import list_checkpoints, resolve

    have = bool(list_checkpoints(root)) or (root / "latest").exists()
    if resume is None:
        if have:
            raise ValueError(
                f"{out} already holds a run (checkpoints in {root}); resume it "
                "(--resume) or choose another --out"
            )
        return None
    if not have:
        raise ValueError(f"nothing to resume: {root} holds no checkpoint; start without --resume")
    info = resolve(root, resume)
    if ranks_as_saved and info.world_size != world:
        raise ValueError(
            f"{info.path} was saved by {info.world_size} ranks and this run has "
            f"{world}: resume with --nproc {info.world_size}"
            f"{_STRATEGY_FLAG.get(info.strategy, '')}, or pass --nproc {world} to go "
            f"on in {'one process' if world == 1 else f'{world} processes'} "
            "(equal within the reduction order)"
        )
    return info


def check_trained_as(info: CheckpointInfo, policy: Policy, optimizer: object, name: str) -> None:
    """Refuse a checkpoint saved under another policy (its descriptive fields aside) or
    with another optimizer class than `optimizer` (the recipe's `name`), before anything
    is loaded."""
    from mixprec.checkpoint.layout import class_name

    saved = dict(info.policy) if info.policy is not None else {}
    diff = [f"{k} (saved {a!r}, now {b!r})" for k, (a, b) in policy.differences(saved).items()]
    if diff:
        was = saved.get("name", "?")
        raise ValueError(
            f"{info.path} was trained under policy {was!r}, this run asks for "
            f"{policy.name!r}; differing fields: {', '.join(diff)}; resume under "
            f"{was!r} or choose another --out"
        )
    if info.optimizer is not None and info.optimizer != class_name(optimizer):
        was = info.optimizer.rsplit(".", 1)[-1].lower()
        raise ValueError(
            f"{info.path} was trained with optimizer {was} ({info.optimizer}), this run "
            f"asks for {name}: resume with --optimizer {was} or choose another --out"
        )


def run_state(
    recipe: Recipe,
    workload: str,
    config: Mapping[str, Any],
    train: TrainSettings,
    *,
    step: int,
    elapsed: float,
) -> dict[str, Any]:
    """What a checkpoint of the run after `step` keeps in its ``extra``."""
    return {
        "data": {"seed": recipe.seed, "step": step},
        "workload": workload,
        "workload_config": config,
        "train": train.to_dict(),
        "optimizer": {"name": recipe.optimizer, "args": _plain(dict(recipe.optimizer_args))},
        "elapsed_s": elapsed,
        "recipe": recipe.to_dict(),
    }


def check_run(
    info: CheckpointInfo, extra: Mapping[str, Any], expected: Mapping[str, Any], recipe_file: Path
) -> None:
    """The checkpoint's data position, workload and training settings are this run's.

    Args:
        info: the checkpoint.
        extra: its ``extra``, as loaded.
        expected: this run's `run_state` at the checkpoint's step.
        recipe_file: the run's recipe (named in the error).

    Raises:
        ValueError: naming every field that differs.
    """
    seed = expected["data"]["seed"]
    saved_data = extra.get("data")
    diff: list[str] = []
    if not isinstance(saved_data, Mapping) or saved_data.get("step") != info.step:
        diff.append(f"data position (saved {saved_data!r}, checkpoint step {info.step})")
    elif saved_data.get("seed") != seed:
        diff.append(f"seed (saved {saved_data.get('seed')!r}, now {seed!r})")
    for key in ("workload", "workload_config"):
        if _plain(extra.get(key)) != expected[key]:
            diff.append(f"{key} (saved {extra.get(key)!r}, now {expected[key]!r})")
    # Checkpoints written before the optimizer was recorded trained AdamW as it came.
    saved_opt = _plain(extra.get("optimizer", {"name": "adamw", "args": {}}))
    if saved_opt != expected["optimizer"]:
        diff.append(f"optimizer (saved {_label(saved_opt)}, now {_label(expected['optimizer'])})")
    saved_train = _plain(extra.get("train"))
    saved_train = saved_train if isinstance(saved_train, dict) else {}
    for k, now in expected["train"].items():
        if saved_train.get(k) != now:
            diff.append(f"{k} (saved {saved_train.get(k)!r}, now {now!r})")
    if diff:
        raise ValueError(
            f"{info.path} belongs to another run: {'; '.join(diff)}; resume with the "
            f"settings of {recipe_file} or choose another --out"
        )


def _label(opt: Any) -> str:
    from mixprec.experiment.optimizer import optimizer_label

    if not isinstance(opt, Mapping) or not isinstance(opt.get("args", {}), Mapping):
        return repr(opt)
    return optimizer_label(str(opt.get("name")), opt.get("args", {}))


def _plain(value: Any) -> Any:
    """`value` as JSON would hold it (tuples as lists)."""
    return json.loads(json.dumps(value, default=str))
