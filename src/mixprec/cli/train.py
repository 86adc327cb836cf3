"""`mixprec train`: one long run of one policy, with checkpoints, resume and export."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Any

from mixprec.cli.common import add_optimizer_flags, emit_json, load_mapping
from mixprec.cli.compare import out_folder
from mixprec.cli.exits import EXIT_INTERRUPTED, EXIT_OK, EXIT_TERMINATED
from mixprec.cli.interrupt import INTERRUPTED, TERMINATED, cooperative_sigterm
from mixprec.cli.tracking import add_track_flags, check_track, tracker_from_args

__all__ = ["add_parser"]

#: Flags that set a recipe field of the same name (flags win over --config).
_FIELD_FLAGS = (
    "workload",
    "size",
    "policy",
    "steps",
    "seed",
    "save_every",
    "eval_every",
    "optimizer",
    "optimizer_args",
)


def add_parser(sub: Any) -> None:
    """Register the ``train`` subcommand."""
    p = sub.add_parser(
        "train",
        help="train one policy on a workload: progress, probes, checkpoints, resume, export",
        description="Train a workload under one precision policy, with a progress bar, the "
        "doctor's runtime probes, checkpoints you can resume bitwise, and an export of the "
        "final weights. Ctrl-C or SIGTERM stops after the current step with a checkpoint.",
    )
    p.add_argument("--config", type=Path, default=None, help="a YAML recipe; flags override it")
    p.add_argument(
        "--workload", default=None, help="shakespeare (default), digits, or module:function"
    )
    p.add_argument("--size", default=None, help="the workload's size preset (e.g. tiny)")
    p.add_argument("--policy", default=None, help="the precision policy (a preset or alias)")
    p.add_argument(
        "--policy-from",
        type=Path,
        default=None,
        metavar="DIR",
        help="train the policy a finished `mixprec compare --out DIR` recommended, on the "
        "workload, size and training settings it compared (flags win; not another workload)",
    )
    p.add_argument("--steps", type=int, default=None, help="optimizer steps of the whole run")
    p.add_argument("--seed", type=int, default=None, help="initial weights and data order")
    add_optimizer_flags(p)
    p.add_argument("--out", type=out_folder, default=Path("runs/train"), help="output folder")
    p.add_argument("--save-every", type=int, default=None, help="steps between checkpoints")
    p.add_argument(
        "--eval-every", type=int, default=None, help="steps between held-out evaluations"
    )
    p.add_argument(
        "--stop-after",
        type=_positive,
        default=None,
        metavar="K",
        help="stop after K steps of this invocation with a checkpoint, as SIGTERM would "
        "(time-sliced clusters: rerun with --resume)",
    )
    p.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        default=None,
        choices=("latest", "latest-valid"),
        help="go on from OUT/checkpoints: the checkpoint 'latest' names (the default) or "
        "the newest that verifies (latest-valid)",
    )
    p.add_argument("--device", default="cpu", help="device to train on (default cpu)")
    p.add_argument(
        "--nproc",
        type=_positive,
        default=None,
        metavar="N",
        help="train data-parallel on N local processes (gloo on CPUs, NCCL on GPUs); under "
        "torchrun, leave it out: the ranks torchrun started are used",
    )
    p.add_argument(
        "--strategy",
        choices=("fsdp2", "ddp"),
        default="fsdp2",
        help="how several ranks share the model: fsdp2 (sharded, the default) or ddp",
    )
    add_track_flags(p)
    p.add_argument("--json", action="store_true", help="no progress; print train.json to stdout")
    p.set_defaults(handler=run)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return value


def _recipe_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The recipe's dict form: --config (or, resuming, the run's own recipe), then
    --policy-from, then the flags."""
    from mixprec.experiment.training import RECIPE_FILE, stored_recipe

    data: dict[str, Any] = {}
    if args.config is not None:
        data = load_mapping(args.config, "a recipe (a YAML mapping)")
        section = data.get("train")
        if isinstance(section, dict):  # a file holding `compare:` and `train:` sections
            others = sorted(str(k) for k in data if k not in ("train", "compare"))
            if others:
                raise ValueError(
                    f"{args.config}: with a 'train:' section, put every recipe key inside it "
                    f"(found {others} beside it)"
                )
            data = dict(section)
    elif args.resume is not None:
        stored = stored_recipe(args.out)
        if stored is None:
            raise ValueError(
                f"nothing to resume: {args.out} holds no run (no {RECIPE_FILE}); start "
                "without --resume, or check --out"
            )
        data = stored
        saved = str(stored.get("optimizer") or "adamw").strip().lower()
        asked = args.optimizer
        if asked is not None and asked.strip().lower() != saved:
            # (before the saved arguments meet another class: they are the saved run's)
            from mixprec.optim import OPTIMIZERS

            cls = OPTIMIZERS.get(saved)
            what = f"{saved} (mixprec.optim.{cls.__name__})" if cls else saved
            raise ValueError(
                f"{args.out} was trained with optimizer {what}, this run asks for "
                f"{asked}: resume with --optimizer {saved} or choose another --out"
            )
    if args.workload is None and ":" in str(data.get("workload", "")):
        raise ValueError(
            f"the recipe names workload {data['workload']!r}: files may only name built-in "
            "workloads (a module:function would run code); pass --workload on the command line"
        )
    if args.policy_from is not None:
        if args.policy is not None:
            raise ValueError("give --policy or --policy-from, not both")
        _take_recommendation(args.policy_from, data, args)
    for key in _FIELD_FLAGS:
        value = getattr(args, key)
        if value is not None:
            data[key] = value
    return data


def _take_recommendation(folder: Path, data: dict[str, Any], args: argparse.Namespace) -> None:
    """The recommended policy, on the workload, size and training settings compared;
    the recipe's keys and the flags win, but not another workload."""
    from mixprec.experiment.compare import recommendation

    rec = recommendation(folder)
    if rec.policy is None:
        raise ValueError(
            f"{folder}: compare recommended no policy ({rec.why_none}); pass --policy instead"
        )
    data["policy"] = rec.policy
    asked = args.workload if args.workload is not None else data.get("workload")
    user_code = ":" in rec.workload  # named on the command line only, never by a file
    if asked is not None and asked != rec.workload:
        same = f"--workload {rec.workload}" if user_code else "no other workload"
        raise ValueError(
            f"{folder} compared the workload {rec.workload!r}, not {asked!r}: train what was "
            f"compared ({same}), or pass --policy {rec.policy} instead of --policy-from to "
            f"train {asked!r} with it"
        )
    if asked is None and user_code:
        raise ValueError(
            f"{folder} compared the workload {rec.workload!r}, which imports code: to train "
            f"it, name it on the command line too: --workload {rec.workload}"
        )
    data["workload"] = rec.workload
    optimizer = args.optimizer if args.optimizer is not None else data.get("optimizer")
    if optimizer is not None and str(optimizer).strip().lower() != rec.optimizer:
        raise ValueError(
            f"{folder} judged policies for optimizer {rec.optimizer}, not {optimizer}: train "
            f"with what was compared (--optimizer {rec.optimizer}), or pass --policy "
            f"{rec.policy} instead of --policy-from to train {optimizer} with it"
        )
    data["optimizer"] = rec.optimizer
    if rec.optimizer_args and args.optimizer_args is None:
        data.setdefault("optimizer_args", dict(rec.optimizer_args))
    if args.size is None and "size" not in data and rec.size is not None:
        data["size"] = rec.size
    for key, value in rec.train.items():  # the recipe's own keys and the flags win
        data.setdefault(key, value)


def _resume_hint(args: argparse.Namespace) -> str:
    words = ["mixprec", "train"]
    if args.workload is not None and ":" in args.workload:  # files never name one
        words += ["--workload", args.workload]
    if args.device != "cpu":  # not part of the recipe
        words += ["--device", args.device]
    from mixprec.distributed import world_size

    if world_size() > 1:  # nor is how the ranks share the work
        words += ["--nproc", str(world_size()), "--strategy", args.strategy]
    if args.track is not None:  # where the run is logged is not part of the recipe either
        words += ["--track", args.track]
        if args.track_uri is not None:
            words += ["--track-uri", args.track_uri]
    return shlex.join([*words, "--out", str(args.out), "--resume"])


def _child_argv(args: argparse.Namespace) -> list[str]:
    """The ``mixprec train`` arguments each rank of ``--nproc`` runs (all but --nproc)."""
    words = ["train"]
    for flag in (
        "config",
        "workload",
        "size",
        "policy",
        "policy_from",
        "steps",
        "seed",
        "optimizer",
        "optimizer_args",
    ):
        words += _flag(flag, getattr(args, flag))
    for flag in ("out", "save_every", "eval_every", "stop_after", "device", "strategy"):
        words += _flag(flag, getattr(args, flag))
    for flag in ("track", "track_uri"):
        words += _flag(flag, getattr(args, flag))
    if args.resume is not None:
        words += ["--resume", args.resume]
    if args.json:
        words.append("--json")
    return words


def _flag(name: str, value: Any) -> list[str]:
    return [] if value is None else ["--" + name.replace("_", "-"), str(value)]


def run(args: argparse.Namespace) -> int:
    """Train (or resume) the run the flags describe; 130/143 when stopped by Ctrl-C/SIGTERM.

    With ``--nproc N`` (not under torchrun) the command runs on N local ranks
    (`mixprec.distributed.spawn`); each rank joins the process group its environment
    describes (`mixprec.distributed.process_group`).
    """
    from mixprec.distributed.launch import launched_world_size, process_group, spawn

    check_track(args)  # a missing extra: one line, before any rank starts
    launched = launched_world_size()
    if args.nproc is not None and launched == 1 and args.nproc > 1:
        return spawn(_child_argv(args), args.nproc)
    if args.nproc is not None and launched > 1 and args.nproc != launched:
        raise ValueError(
            f"--nproc {args.nproc} differs from the {launched} ranks torchrun started; leave "
            "--nproc out under torchrun"
        )
    with process_group(args.device) as device:
        # A resume with neither --nproc nor torchrun choosing the ranks goes on as saved.
        return _train(args, device, ranks_as_saved=args.nproc is None and launched == 1)


def _train(args: argparse.Namespace, device: str, *, ranks_as_saved: bool) -> int:
    from mixprec.checkpoint import CheckpointError
    from mixprec.distributed import rank
    from mixprec.experiment.recipe import Recipe
    from mixprec.experiment.training import train

    with cooperative_sigterm():
        # Everything that can be refused is checked before any output: one line.
        recipe = Recipe.from_dict(_recipe_from_args(args))
        allow_import = args.workload is not None and ":" in args.workload
        try:
            result = train(
                recipe,
                args.out,
                resume=args.resume,
                stop_after=args.stop_after,
                device=device,
                allow_import=allow_import,
                stream=None if args.json else sys.stderr,
                should_stop=lambda: INTERRUPTED.is_set() or TERMINATED.is_set(),
                strategy=args.strategy,
                tracker=tracker_from_args(args, args.out) if rank() == 0 else None,
                ranks_as_saved=ranks_as_saved,
            )
        except CheckpointError as exc:  # the library's spelling of the option, as a flag
            raise CheckpointError(
                str(exc).replace("resume='latest-valid'", "--resume latest-valid")
            ) from None
    summary = result.summary
    if not result.finished:
        if INTERRUPTED.is_set():
            why, code = "Ctrl-C", EXIT_INTERRUPTED
        elif TERMINATED.is_set():
            why, code = "SIGTERM", EXIT_TERMINATED
        elif args.stop_after is None:  # every rank stops when any rank is asked to
            why, code = "a stop request on another rank", EXIT_TERMINATED
        else:
            why, code = f"--stop-after {args.stop_after}", EXIT_OK
        if result.checkpoint is None:
            where = "no checkpoint saved (no step was taken)"
        else:
            where = f"checkpoint {result.checkpoint}; resume with: {_resume_hint(args)}"
        if rank() == 0:
            print(
                f"mixprec train: stopped ({why}) after step {result.step} of {result.steps}; "
                f"{where}",
                file=sys.stderr,
            )
    else:
        INTERRUPTED.clear()  # a stop request that came during the last step: it finished
        code = EXIT_OK
    if rank() != 0:  # rank 0 reports
        return code
    if args.json:
        emit_json(summary)
    elif result.finished:
        print(_finished_text(summary, args.out))
    return code


def _number(value: Any, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _finished_text(summary: dict[str, Any], out: Path) -> str:
    final = summary.get("final") or {}
    rate = summary.get("steps_per_s")
    lines = [
        f"finished: {summary['steps']} steps of {summary['workload']} under "
        f"{summary['policy']} in {summary['wall_time_s']:.1f}s"
        + ("" if rate is None else f" ({rate:.1f} steps/s this invocation)"),
        f"held-out loss {_number(final.get('eval_loss'), '.4f')}  "
        f"{summary['metric_name']} {_number(final.get('eval_metric'), '.4f')}  "
        f"skipped steps {summary['skipped_steps']}",
    ]
    ckpt = summary.get("checkpoint")
    if ckpt is not None:
        parts = ", ".join(f"{k} {_size(v)}" for k, v in sorted(ckpt["components"].items()))
        lines.append(f"checkpoint: {out / ckpt['path']} ({_size(ckpt['bytes'])}: {parts})")
    export = summary.get("export")
    if export is not None:
        lines.append(f"export: {out / export['path']} ({export['dtype']})")
    lines.append(f"metrics: {out / 'metrics.jsonl'}  summary: {out / 'train.json'}")
    if summary.get("tracked"):
        lines.append(f"tracked: {summary['tracked']}")
    return "\n".join(lines)


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    value = n / 1024
    for unit in ("KiB", "MiB"):
        if value < 1024:
            return f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"
