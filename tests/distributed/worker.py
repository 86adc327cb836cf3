"""One rank of the distributed tests (launched twice by `launch.run_ranks`).

Usage: RANK=r WORLD_SIZE=2 MASTER_ADDR=... MASTER_PORT=... python worker.py OUT SCENARIO...
Runs each scenario on this rank and writes ``OUT/rank<r>.pt`` with the results by
scenario name (a scenario that raises records its message under ``"error"``).
"""

from __future__ import annotations

import os
import shutil
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.overrides import TorchFunctionMode

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
sys.path.insert(0, str(Path(__file__).parent))

import cases

import mixprec
from mixprec.distributed import ddp, process_group, shard

SCENARIOS: dict[str, Callable[[], Any]] = {}


def scenario(fn: Callable[[], Any]) -> Callable[[], Any]:
    SCENARIOS[fn.__name__] = fn
    return fn


# ------------------------------------------------------------------ parity


def _fsdp(model: nn.Module, prec: mixprec.Precision) -> nn.Module:
    return shard(model, prec.policy)


def _ddp(model: nn.Module, prec: mixprec.Precision) -> nn.Module:
    return ddp(model, prec.policy)


@scenario
def fsdp_parity() -> dict[str, Any]:
    return {p: cases.train(p, wrap=_fsdp) for p in cases.POLICIES}


@scenario
def fsdp_parity_noclip() -> dict[str, Any]:
    return {p: cases.train(p, wrap=_fsdp, clip=None) for p in cases.POLICIES}


@scenario
def ddp_parity() -> dict[str, Any]:
    return {p: cases.train(p, wrap=_ddp) for p in cases.POLICIES}


@scenario
def ddp_default_fp32() -> dict[str, Any]:
    """Plain DDP (its own all-reduce), to compare with `ddp`'s hook in fp32."""
    return cases.train("fp32", wrap=lambda m, _: nn.parallel.DistributedDataParallel(m))


# ------------------------------------------------------------------ payload


class Recorder:
    """Records the dtype of every gradient collective (patched over torch.distributed)."""

    def __init__(self) -> None:
        self.dtypes: list[str] = []
        self.saved = {n: getattr(dist, n) for n in ("all_reduce", "reduce_scatter_single")}

    def __enter__(self) -> Recorder:
        for name, fn in self.saved.items():
            setattr(dist, name, self._recording(fn))
        return self

    def _recording(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            tensor = next(a for a in [*args, *kwargs.values()] if isinstance(a, torch.Tensor))
            self.dtypes.append(str(tensor.dtype).removeprefix("torch."))
            return fn(*args, **kwargs)

        return call

    def __exit__(self, *exc: object) -> None:
        for name, fn in self.saved.items():
            setattr(dist, name, fn)


def _payload(policy: mixprec.Policy, wrap: Callable[..., nn.Module]) -> list[str]:
    prec = mixprec.Precision(policy)
    model = prec.prepare(wrap(cases.make_model(), prec))
    loss = cases.loss_of(prec, model, *cases.batch(0, dist.get_rank()))
    with Recorder() as rec:
        prec.backward(loss)
    return sorted(set(rec.dtypes))


@scenario
def payload() -> dict[str, Any]:
    out = {}
    for name in ("amp_bf16", "bf16_master"):
        for reduce in (torch.float32, torch.bfloat16):
            pol = mixprec.preset(name).replace(reduce_dtype=reduce)
            key = f"{name}/{str(reduce).removeprefix('torch.')}"
            out[f"fsdp2 {key}"] = _payload(pol, _fsdp)
            out[f"ddp {key}"] = _payload(pol, _ddp)
    return out


# ------------------------------------------------------------------ order


def _raw_fully_shard(model: nn.Module, mp: MixedPrecisionPolicy | None = None) -> nn.Module:
    kwargs = {} if mp is None else {"mp_policy": mp}
    for layer in model.layers:
        fully_shard(layer, **kwargs)
    return fully_shard(model, **kwargs)


def _error(fn: Callable[[], Any]) -> str | None:
    try:
        fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


@scenario
def order() -> dict[str, Any]:
    out: dict[str, Any] = {}
    prec = mixprec.Precision("bf16_master")
    out["fully_shard then prepare"] = _error(
        lambda: prec.prepare(_raw_fully_shard(cases.make_model()))
    )
    out["ddp then prepare"] = _error(
        lambda: prec.prepare(nn.parallel.DistributedDataParallel(cases.make_model()))
    )

    # Storage set by hand before wrapping, but the wrappers' own defaults reduce bf16
    # gradients in bf16, not in the policy's fp32.
    def prepared() -> nn.Module:
        return mixprec.Precision("bf16_master").prepare(cases.make_model())

    out["raw ddp of a prepared model"] = _error(
        lambda: prec.prepare(nn.parallel.DistributedDataParallel(prepared()))
    )
    out["raw fully_shard of a prepared model"] = _error(
        lambda: prec.prepare(
            _raw_fully_shard(prepared(), MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        )
    )
    out["shard twice"] = _error(lambda: shard(shard(cases.make_model(), "fp32"), "fp32"))

    # Both orders of shard and prepare train, and agree bitwise.
    def prepare_first(model: nn.Module, p: mixprec.Precision) -> nn.Module:
        return shard(p.prepare(model), p.policy)

    out["prepare then shard"] = cases.train("bf16_master", wrap=prepare_first)
    out["shard then prepare"] = cases.train("bf16_master", wrap=_fsdp)
    # fp32 islands survive sharding: their parameters stay fp32 and run in fp32.
    model = shard(cases.make_model(), "bf16_master")
    seen: dict[str, str] = {}

    class Note(TorchFunctionMode):
        # The unsharded weight the norm computed with, and the input it computed on
        # (inside the island, after its upcast).
        def __torch_function__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            kwargs = kwargs or {}
            if func is torch.nn.functional.layer_norm:
                seen["norm"] = f"weight {kwargs['weight'].dtype}, input {args[0].dtype}"
            return func(*args, **kwargs)

    with mixprec.Precision("bf16_master").autocast(), Note():
        model(cases.batch(0, 0)[0])
    out["island dtypes"] = {n: str(p.dtype) for n, p in model.named_parameters()}
    out["island forward"] = seen
    return out


# ------------------------------------------------------------------ skips


def _inject_after_reduce(model: nn.Module, rank: int) -> None:
    """A rank-local edit after the reduction: rank 1's first gradient gets an inf."""
    if rank == 1:
        p = next(p for p in model.parameters() if p.grad is not None)
        g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        g.view(-1)[0] = float("inf")


def skip_run(policy: str, strategy: str, mode: str, steps: int = 5, bad: int = 2):
    prec = mixprec.Precision(policy)
    model = cases.make_model()
    model = shard(model, prec.policy) if strategy == "fsdp2" else ddp(model, prec.policy)
    model = prec.prepare(model)
    opt = prec.optimizer(model, lr=3e-3)
    rank = dist.get_rank()
    reports = []
    for step in range(steps):
        inject = step == bad
        x, y = cases.batch(step, rank)
        if mode == "micro":  # two micro-batches, the first without gradient sync
            sync_off = model.no_sync() if strategy == "ddp" else _FsdpNoSync(model)
            with sync_off:
                loss = cases.loss_of(prec, model, x[:2], y[:2])
                if inject and rank == 0:
                    loss = loss * float("inf")
                prec.backward(loss / 2)
            prec.backward(cases.loss_of(prec, model, x[2:], y[2:]) / 2)
        else:
            loss = cases.loss_of(prec, model, x, y)
            if inject and mode == "before" and rank == 1:
                loss = loss * float("inf")
            prec.backward(loss)
            if inject and mode == "after":
                _inject_after_reduce(model, rank)
        report = prec.step(opt)
        opt.zero_grad(set_to_none=True)
        reports.append((report.applied, report.nonfinite_grads, report.grad_norm, report.scale))
    params = [cases.full(p) for p in model.parameters()]
    return {"reports": reports, "params": params}


class _FsdpNoSync:
    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __enter__(self) -> None:
        self.model.set_requires_gradient_sync(False)

    def __exit__(self, *exc: object) -> None:
        self.model.set_requires_gradient_sync(True)


@scenario
def skips() -> dict[str, Any]:
    out = {}
    for policy in ("amp_fp16", "bf16_master"):
        for strategy in ("ddp", "fsdp2"):
            for mode in ("before", "after", "micro"):
                out[f"{policy} {strategy} {mode}"] = skip_run(policy, strategy, mode)
    return out


# ------------------------------------------------------------------ doctor


def _findings(policy: mixprec.Policy | str, model: nn.Module) -> list[dict[str, Any]]:
    import mixprec.doctor

    return [f.to_dict() for f in mixprec.doctor.check(policy=policy, model=model)]


@scenario
def doctor() -> dict[str, Any]:
    """What `mixprec.doctor.check` reads from live FSDP2 and DDP wrappers."""
    bf16_reduce = mixprec.preset("bf16_master").replace(reduce_dtype=torch.bfloat16)

    def prepared(name: str) -> nn.Module:
        return mixprec.Precision(name).prepare(cases.make_model())

    return {
        "shard bf16_master": _findings("bf16_master", shard(cases.make_model(), "bf16_master")),
        "shard bf16 reduce": _findings(bf16_reduce, shard(cases.make_model(), bf16_reduce)),
        "raw fully_shard amp_bf16": _findings(
            mixprec.Precision("amp_bf16"), _raw_fully_shard(prepared("amp_bf16"))
        ),
        "raw ddp bf16_master": _findings(
            "bf16_master", nn.parallel.DistributedDataParallel(prepared("bf16_master"))
        ),
        "numel": sum(p.numel() for p in cases.make_model().parameters()),
    }


@scenario
def load_mismatch() -> dict[str, Any]:
    """Found by review: ranks calling a collective load with other arguments."""
    import tempfile

    from mixprec import checkpoint

    root = Path(tempfile.gettempdir()) / f"mixprec-load-mismatch-{os.environ['MASTER_PORT']}"
    prec = mixprec.Precision("bf16_master")
    model = prec.prepare(shard(cases.make_model(), prec))
    opt = prec.optimizer(model, lr=1e-3)
    for step in (1, 2):
        checkpoint.save(root, model=model, optimizer=opt, precision=prec, step=step)
    rank = dist.get_rank()
    out = {
        "resume": _error(
            lambda: checkpoint.load(
                root, model=model, optimizer=opt, precision=prec, resume=1 + rank
            )
        ),
        "optimizer": _error(
            lambda: checkpoint.load(
                root, model=model, optimizer=opt if rank == 0 else None, precision=prec
            )
        ),
        "same": checkpoint.load(root, model=model, optimizer=opt, precision=prec)["step"],
    }
    dist.barrier()
    if rank == 0:
        shutil.rmtree(root)
    return out


def main() -> None:
    out, names = Path(sys.argv[1]), sys.argv[2:]
    torch.set_num_threads(1)
    # The group's teardown collects the scenarios' objects first (mixprec.distributed).
    with process_group("cpu"):
        results: dict[str, Any] = {}
        for name in names:
            try:
                results[name] = SCENARIOS[name]()
            except Exception:
                results[name] = {"error": traceback.format_exc()}
        torch.save(results, out / f"rank{dist.get_rank()}.pt")


if __name__ == "__main__":
    main()
