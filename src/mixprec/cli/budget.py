"""`mixprec budget`: memory and communication by component for a policy."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any, Literal

from mixprec.cli.common import UsageError, emit_json, load_mapping, table

__all__ = ["add_parser", "parse_count"]


def add_parser(sub: Any) -> None:
    """Register the ``budget`` subcommand."""
    p = sub.add_parser("budget", help="memory and communication by component for a policy")
    p.add_argument("--params", default=None, help="parameter count (7e9, 7B, 350M)")
    p.add_argument("--config", default=None, help="a transformers-style config (JSON or YAML)")
    p.add_argument(
        "--model",
        default=None,
        help="MODULE:FUNCTION returning an nn.Module, built on the meta device (exact per "
        "tensor, no memory used)",
    )
    p.add_argument("--policy", default="all", help="a preset, comma-separated presets, or all")
    p.add_argument("--world-size", type=int, default=1, help="number of ranks")
    p.add_argument(
        "--sharding",
        choices=["fsdp", "ddp"],
        default=None,
        help="with --world-size > 1 (default fsdp)",
    )
    p.add_argument("--seq-len", type=int, default=None, help="sequence length (with --config)")
    p.add_argument(
        "--micro-batch", type=int, default=None, help="sequences per rank (with --config)"
    )
    p.add_argument("--activations", default=None, help="activation values saved for backward")
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="the device type trained on: autocast's, and for fp8 policies the GEMM path "
        "(cpu: emulated; cuda: FP8 units, sm_89+) the cast temporaries are sized for",
    )
    p.add_argument(
        "--grad-accum-dtype",
        choices=["fp32"],
        default=None,
        help="sum 16-bit gradients over micro-batches in fp32 (Policy.grad_accum_dtype) in "
        "every policy: counts the sums as grad_accum",
    )
    p.add_argument(
        "--optimizer",
        default="adamw",
        help="the mixprec optimizer trained with (adamw, adam, sgd, lion): its update rule "
        "decides the moments counted (default adamw)",
    )
    p.add_argument(
        "--optimizer-args",
        default=None,
        metavar="K=V,...",
        help="its keyword arguments, e.g. momentum=0.9,nesterov=true or amsgrad=true",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(handler=run)


_MAX_COUNT = 1e15  # a thousand times today's largest models

_SUFFIX = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def parse_count(text: str) -> int:
    """``7e9``, ``7B``, ``350M``, ``1_000`` -> an integer count."""
    raw = text.strip().lower().replace("_", "").replace(",", "")
    scale = 1.0
    if raw and raw[-1] in _SUFFIX:
        scale, raw = _SUFFIX[raw[-1]], raw[:-1]
    try:
        value = float(raw) * scale
    except ValueError:
        raise UsageError(f"mixprec budget: {text!r} is not a count (e.g. 7e9, 7B, 350M)") from None
    if not 1 <= value <= _MAX_COUNT:  # also refuses NaN and inf
        raise UsageError(
            f"mixprec budget: the count must be a number from 1 to {_MAX_COUNT:.0e} "
            f"(e.g. 7e9, 7B, 350M), got {text!r}"
        )
    return round(value)


def run(args: argparse.Namespace) -> int:
    """Print the memory and communication breakdown (or JSON)."""
    import dataclasses

    from mixprec.dtypes import parse_dtype
    from mixprec.experiment.optimizer import parse_optimizer_args
    from mixprec.memory import TransformerShape, estimate, optimizer_rule
    from mixprec.policy import PRESET_NAMES, preset

    if sum(x is not None for x in (args.params, args.config, args.model)) != 1:
        raise UsageError(
            "mixprec budget: give exactly one of --params N, --config FILE or "
            "--model MODULE:FUNCTION"
        )
    if args.world_size < 1:
        raise UsageError(f"mixprec budget: --world-size must be >= 1, got {args.world_size}")
    if args.config is None and (args.seq_len is not None or args.micro_batch is not None):
        raise UsageError(
            "mixprec budget: --seq-len and --micro-batch size activations from a model config: "
            "give --config FILE, or --activations N with --params"
        )
    if args.sharding is not None and args.world_size == 1:
        raise UsageError(
            f"mixprec budget: --sharding {args.sharding} needs --world-size > 1 (one rank "
            "shards nothing)"
        )
    for flag, value in (("--seq-len", args.seq_len), ("--micro-batch", args.micro_batch)):
        if value is not None and value < 1:
            raise UsageError(f"mixprec budget: {flag} must be >= 1, got {value}")
    try:  # (compare's and train's parser: one spelling, values read as data)
        optimizer_args = parse_optimizer_args(args.optimizer_args or "")
        rule = optimizer_rule(args.optimizer, optimizer_args)  # refused here: one line
    except ValueError as exc:
        given = f" --optimizer-args {args.optimizer_args}" if args.optimizer_args else ""
        raise UsageError(f"mixprec budget: --optimizer {args.optimizer}{given}: {exc}") from None
    names = (
        list(PRESET_NAMES) if args.policy == "all" else [n.strip() for n in args.policy.split(",")]
    )
    left_out = []  # `all` on several ranks or with accumulation: release runs in neither
    if args.policy == "all" and (args.world_size > 1 or args.grad_accum_dtype is not None):
        left_out = [n for n in names if preset(n).release_gradients]
        names = [n for n in names if n not in left_out]
    source: Any
    if args.config is not None:
        try:
            source = TransformerShape.from_config(
                load_mapping(args.config, "a mapping of config keys"),
                seq_len=args.seq_len,
                micro_batch=args.micro_batch,
            )
        except ValueError as exc:
            said = str(exc)  # the loader's errors name the file already
            raise ValueError(
                said if said.startswith(str(args.config)) else f"{args.config}: {said}"
            ) from None
        total = sum(source.param_counts())
        if total > _MAX_COUNT:
            raise UsageError(
                f"mixprec budget: {args.config} describes {total:.3g} parameters, more than "
                f"{_MAX_COUNT:.0e}: check its sizes"
            )
    elif args.model is not None:
        source = _load_model(args.model)
    else:
        source = parse_count(args.params)
    activations = parse_count(args.activations) if args.activations else None
    sharding: Literal["none", "fsdp", "ddp"] = (
        (args.sharding or "fsdp") if args.world_size > 1 else "none"
    )
    policies: list[Any] = list(names)
    if args.grad_accum_dtype is not None:
        accum = parse_dtype(args.grad_accum_dtype)
        policies = [dataclasses.replace(preset(n), grad_accum_dtype=accum) for n in names]
    results = [
        estimate(
            source,
            n,
            world_size=args.world_size,
            sharding=sharding,
            activation_values=activations,
            device_type=args.device,
            optimizer=args.optimizer,
            optimizer_args=optimizer_args,
        )
        for n in policies
    ]
    if args.json:
        payload = [r.to_dict() for r in results]
        emit_json(payload if len(payload) > 1 else payload[0])
        return 0
    print(_optimizer_line(args.optimizer, optimizer_args, rule))
    print(_budget_table(results, args.world_size))
    if left_out:
        print(
            f"note: {', '.join(left_out)} left out: gradient release runs in one process with "
            "one backward per step (docs/release.md)"
        )
    if isinstance(source, TransformerShape):
        given = "--seq-len" if args.seq_len is not None else "the config's longest sequence"
        print(
            f"note: activations for sequences of {source.seq_len:,} tokens ({given}), micro-batch "
            f"{source.micro_batch} per rank; --seq-len and --micro-batch size them"
        )
    return 0


def _optimizer_line(name: str, args: dict[str, Any], rule: str) -> str:
    """What the moments column counts: the optimizer, its rule and the rule's moments."""
    from mixprec.optim.rules import RULES

    given = ", ".join(f"{k}={v!r}" for k, v in args.items())
    slots = [key for key, _ in RULES[rule].slots]
    kept = (
        f"keeps {', '.join(slots)} per parameter, in each policy's moment format"
        if slots
        else "keeps no moments"
    )
    return f"optimizer: {name}({given}), rule {rule}: {kept}"


def _load_model(spec: str) -> Any:
    """``MODULE:FUNCTION`` -> the module it returns, built on the meta device."""
    import importlib

    import torch

    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise UsageError(f"mixprec budget: --model needs MODULE:FUNCTION, got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name is None or not (
            module_name == error.name or module_name.startswith(error.name + ".")
        ):
            raise  # a missing import inside the user's module is their bug
        raise UsageError(
            f"mixprec budget: --model {spec!r}: cannot import {module_name!r}; is it on "
            "sys.path (PYTHONPATH)?"
        ) from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise UsageError(f"mixprec budget: --model {spec!r}: {module_name} has no function {attr}")
    with torch.device("meta"):  # shapes only: a 70B model costs no memory here
        model = factory()
    if not isinstance(model, torch.nn.Module):
        raise UsageError(
            f"mixprec budget: --model {spec!r} returned {type(model).__name__}, not an nn.Module"
        )
    return model


_NO_ACTIVATIONS = (
    "activations n/a: not estimated (totals leave them out); give --activations N (values "
    "saved for backward by one rank's micro-batch) with --params, or --config FILE "
    "[--seq-len S --micro-batch B] to size them from the model"
)

#: The components of training state (`MemoryBreakdown.state_bytes_per_param`).
_STATE = ("params", "fp32_islands", "grads", "grad_accum", "master", "moments")

#: Table headers of components whose name is too wide for a column (said under the table).
_HEADER = {
    "fp32_islands": "islands",
    "fp8_cast_temporaries": "fp8_casts",
    "grad_accum": "accum",
    "released_grads": "released",
    "activations": "activ",
}


def _budget_table(results: Sequence[Any], world_size: int) -> str:
    """One row per policy, one column per component (each value in its own unit): rank
    0's bytes, and with several ranks their sum and the communication below."""
    from mixprec.memory import COMPONENTS, format_bytes

    first = results[0]
    fp8 = any(r.fp8 is not None for r in results)
    buffers = any(r.bytes.buffers for r in results)
    grad_accum = any(r.per_rank.grad_accum for r in results)  # grad_accum_dtype: fp32 asked
    released = any(r.per_rank.released_grads for r in results)  # release_gradients
    # No fp8 policy, or no buffers (a count, a config): a column of zeros says nothing.
    comps = [
        c
        for c in COMPONENTS
        if (c != "fp8_cast_temporaries" or fp8)
        and (c != "buffers" or buffers)
        and (c != "grad_accum" or grad_accum)
        and (c != "released_grads" or released)
    ]

    def cell(r: Any, held: Any, comp: str) -> str:
        unknown = comp == "fp8_cast_temporaries" and r.fp8 is not None and not r.fp8.estimated
        if (comp == "activations" and not r.activations_estimated) or unknown:
            return "n/a"
        return format_bytes(getattr(held, comp))

    def memory(per_rank: bool) -> str:
        headers = ["policy", *[_HEADER.get(c, c) for c in comps], "total"]
        headers += ["B/param"] if per_rank else []
        rows = []
        for r in results:
            held = r.per_rank if per_rank else r.bytes
            row = [r.policy, *[cell(r, held, c) for c in comps], format_bytes(held.total)]
            rows.append(row + ([f"{r.state_bytes_per_param:.2f}"] if per_rank else []))
        return table(headers, rows)

    def per_param() -> str:
        """Training state per parameter by component, on `state_bytes_per_param`'s basis."""
        shown = [c for c in _STATE if c != "grad_accum" or grad_accum]
        rows = []
        for r in results:
            held = r.bytes if r.sharding == "fsdp" else r.per_rank
            n = r.params or 1
            # nothing held is "0", as "0 B" above: a figure never rounds to 0.00
            cells = [f"{getattr(held, c) / n:.2f}" if getattr(held, c) else "0" for c in shown]
            rows.append([r.policy, *cells, f"{r.state_bytes_per_param:.2f}"])
        return table(["policy", *[_HEADER.get(c, c) for c in shown], "total"], rows)

    if world_size == 1:
        lines = [f"{first.params:,} parameters, one rank", "", "Per rank:", memory(True)]
    else:
        held = (
            f"rank 0 of {world_size}, the largest shard"
            if first.sharding == "fsdp"
            else f"each of {world_size} holds the same"
        )
        lines = [
            f"{first.params:,} parameters, {first.sharding} over {world_size} ranks",
            "",
            f"Per rank ({held}):",
            memory(True),
            "",
            f"All {world_size} ranks summed:",
            memory(False),
        ]
        keys = [
            k
            for k in ("all_gather", "reduce_scatter", "all_reduce")
            if any(r.comm_bytes_per_step.get(k) for r in results)
        ]
        if keys:
            headers = ["policy"] + [h for k in keys for h in (k, f"(all {world_size})")]
            rows = [
                [r.policy]
                + [
                    format_bytes(v)
                    for k in keys
                    for v in (r.comm_bytes_per_step[k], r.comm_bytes_per_step_all_ranks[k])
                ]
                for r in results
            ]
            lines += ["", "Communication per step (each rank's buffer; all ranks):"]
            lines.append(table(headers, rows))
    lines += ["", "Bytes per parameter (training state of one model copy):", per_param()]
    notes = sorted({n for r in results for n in r.notes if not n.startswith("activations not")})
    if not all(r.activations_estimated for r in results):
        notes.append(_NO_ACTIVATIONS)
    lines += ["", *[f"note: {n}" for n in notes]] if notes else []
    lines.append(
        "B/param: training state (params, islands, grads, accum, master, moments) of one "
        "model copy per parameter"
    )
    lines.append("islands: fp32_islands, parameters of modules kept in fp32 (norms)")
    lines.append("activ: activations, tensors saved for backward by one micro-batch")
    if any(r.per_rank.grad_accum for r in results):
        lines.append(
            "accum: grad_accum, fp32 sums of 16-bit gradients, held from a step's second "
            "micro-batch"
        )
        lines.append("  to its update (grad_accum_dtype: fp32; see docs/memory.md)")
    if any(r.per_rank.released_grads for r in results):
        lines.append(
            "released: released_grads, gradients released in backward: at most the largest "
            "is held at once, during backward (in the total, not in B/param; docs/release.md)"
        )
    if fp8:
        lines.append(
            "fp8_casts: fp8_cast_temporaries, the most one converted linear allocates and frees"
        )
        lines.append(
            "  again in its forward or backward (eager torchao casts; docs/memory.md, FP8)"
        )
    if world_size > 1:
        lines.append(
            f"communication: a ring sends about {world_size - 1}/{world_size} of an all-gather "
            "or reduce-scatter buffer per rank"
        )
    if first.sharding == "fsdp":
        lines.append(
            "rank 0 holds the largest shard: FSDP2 splits dim 0 of each tensor as torch.chunk"
        )
    return "\n".join(lines)
