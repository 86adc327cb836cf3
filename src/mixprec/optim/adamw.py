"""`AdamW`: a drop-in `torch.optim.AdamW` with explicit master and moment formats.

The class only owns state and calls the pure pieces: formats are resolved once
per parameter when its group is added, state is made at a parameter's first
step (as torch's optimizers do: a frozen parameter never gets any), and each
step runs one fused kernel per parameter (`mixprec.optim.kernels`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from numbers import Integral
from typing import Any

import torch
from torch.optim.optimizer import ParamsT

from mixprec import ctrl_c
from mixprec.dtypes import dtype_name
from mixprec.errors import PrecisionError
from mixprec.formats import (
    MasterFormat,
    MomentFormat,
    check_master,
    check_moments,
    master_spec,
)
from mixprec.formats.catalog import DEFAULT_MASTER, DEFAULT_MOMENTS
from mixprec.optim import ops, sharding
from mixprec.optim.batches import GroupHyper, StepBatch, StepKernel, kernel_for, state_misfit
from mixprec.optim.kernels import KernelMode, resolve_mode
from mixprec.optim.layout import flat_view, like_param
from mixprec.optim.options import check_hyper, refuse_unsupported, scalar
from mixprec.optim.param_plan import (
    ParamPlan,
    check_param,
    fresh_state,
    plan_param,
    refuse_shared_memory,
)
from mixprec.optim.replay import (
    PreparedGroup,
    counter_value,
    prepare_group,
    version_marker,
    wrote,
)
from mixprec.optim.resync import reset_master, resync_master
from mixprec.optim.state_dicts import StateConversion, read_state_dict, to_torch

__all__ = ["AdamW"]


def _local_grad(p: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    if sharding.is_dtensor(p) != sharding.is_dtensor(grad) or (
        sharding.is_dtensor(p) and grad.placements != p.placements  # type: ignore[attr-defined]
    ):
        got = getattr(grad, "placements", "a plain tensor")
        want = getattr(p, "placements", "a plain tensor")
        raise ValueError(
            f"gradient of parameter {tuple(p.shape)} is {got} but the parameter is {want}; "
            "mixprec AdamW steps each shard locally and needs them sharded alike"
        )
    return sharding.local(grad)


_PLAIN = (torch.nn.Parameter, torch.Tensor)


def _follow_layout(lp: torch.Tensor, state: dict[str, torch.Tensor], plan: ParamPlan) -> None:
    """Lay `state`'s per-element tensors out like `lp` again if the parameter's layout
    changed since they were made (``module.to(memory_format=...)`` assigns ``p.data``):
    the step pairs state with parameter in memory order, so their strides must agree.
    ``copy_`` moves values by logical index, so each keeps its element."""
    for key in plan.element_keys:
        t = state[key]
        if t.stride() != lp.stride() and t.shape == lp.shape:
            relaid = torch.empty_like(lp, dtype=t.dtype)
            relaid.copy_(t)
            state[key] = relaid


@dataclass
class _BatchWrite:
    """A native batch of the step under way (`AdamW._reconcile`)."""

    params: list[torch.Tensor]
    versions: list[int]  # before the batch
    step_counter: torch.Tensor  # the first parameter's
    step_before: float | None
    marker: torch.Tensor  # bumped with the parameters (`replay.version_marker`)


#: The keys a step reads from every param group (the constructor and
#: `add_param_group` fill them).
_GROUP_KEYS = frozenset(
    ("params", "lr", "betas", "eps", "weight_decay", "maximize", "master", "moments")
)


def _check_group(group: dict[str, Any], index: int) -> GroupHyper:
    """`group`'s hyperparameters as floats, checked as the constructor checks them: an
    edit after it (``betas=(1.0, 0.9)``, ``eps=0``, ``lr="0.5"``, a deleted key) must
    not reach a kernel. Raises `ValueError` naming the group; nothing has stepped."""
    if not group.keys() >= _GROUP_KEYS:
        missing = sorted(_GROUP_KEYS - group.keys())
        raise ValueError(
            f"param group {index} has no {', '.join(map(repr, missing))} (nothing was "
            "stepped): groups made by the constructor or add_param_group have every key; "
            "put it back (e.g. group['maximize'] = False)"
        )
    lr, betas, eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    if not (  # the usual case, checked cheaply: plain floats and a bool
        type(lr) is float
        and type(betas) is tuple
        and len(betas) == 2
        and type(betas[0]) is float
        and type(betas[1]) is float
        and type(eps) is float
        and type(wd) is float
        and type(group["maximize"]) is bool
    ):
        try:
            check_hyper(lr, betas, eps, wd)
        except ValueError as exc:
            raise ValueError(f"param group {index}: {exc} (nothing was stepped)") from None
        if not isinstance(group["maximize"], bool):
            raise ValueError(
                f"param group {index}: maximize={group['maximize']!r} must be True or False "
                "(nothing was stepped)"
            )
    hyper = GroupHyper(
        lr=scalar(lr),
        beta1=scalar(betas[0]),
        beta2=scalar(betas[1]),
        eps=float(eps),
        weight_decay=scalar(wd),
    )
    if not (
        0.0 <= hyper.lr < math.inf
        and 0.0 <= hyper.beta1 < 1.0
        and 0.0 <= hyper.beta2 < 1.0
        and 0.0 < hyper.eps < math.inf
        and 0.0 <= hyper.weight_decay < math.inf
    ):
        raise ValueError(
            f"param group {index}: lr={hyper.lr!r}, betas=({hyper.beta1!r}, {hyper.beta2!r}), "
            f"eps={hyper.eps!r}, weight_decay={hyper.weight_decay!r}: need a finite lr >= 0, "
            "betas in [0, 1), a finite eps > 0 and a finite weight_decay >= 0 (nothing was "
            "stepped)"
        )
    return hyper


def _repeat_rounds(params: list[torch.Tensor]) -> list[int] | None:
    """For a group that lists a parameter more than once: each entry's round (0 for
    its first listing, 1 for its second, ...); None when every parameter is listed
    once (the common case)."""
    if len(set(map(id, params))) == len(params):
        return None
    seen: dict[int, int] = {}
    rounds = []
    for p in params:
        rounds.append(seen.get(id(p), 0))
        seen[id(p)] = rounds[-1] + 1
    return rounds


def _add_to_batch(
    batch: StepBatch,
    p: torch.Tensor,
    grad: torch.Tensor,
    state: dict[str, torch.Tensor],
    plan: ParamPlan,
) -> None:
    """Append `p` (its local shard), its gradient and its state to `batch`, as the
    kernels take them: contiguous, or flat views in memory order (channels-last).
    (`AdamW.step` inlines the case of a plain contiguous parameter.)"""
    lp = sharding.local(p.detach())  # a DTensor's local shard
    if not sharding.is_dtensor(p):
        _follow_layout(lp, state, plan)
    lgrad = like_param(_local_grad(p, grad), lp)
    masters = [sharding.local(state[k]) for k in plan.master_keys]
    moments = [sharding.local(state[k]) for k in plan.moment_keys]
    if not lp.is_contiguous():  # dense in another order (channels-last): flat views
        lp, lgrad = flat_view(lp), flat_view(lgrad)
        masters = [flat_view(t) for t in masters]
        moments = [flat_view(t) for t in moments]
    batch.params.append(lp)
    batch.grads.append(lgrad)
    batch.master_state.extend(masters)
    batch.moment_state.extend(moments)
    batch.steps.append(state["step"])
    if plan.uses_noise:
        batch.seeds.append(state["rng_seed"])
        batch.offsets.append(sharding.global_flat_offset(p) or 0)
    else:
        batch.offsets.append(0)


class AdamW(torch.optim.Optimizer):
    """AdamW with decoupled weight decay and a chosen master/moment storage.

    Takes `torch.optim.AdamW`'s signature; bias correction and operation order
    follow it. Parameters may be fp32, bf16 or fp16 (float64 raises: the update
    is computed in fp32). torch options it cannot honour raise `ValueError`
    instead of being ignored: ``amsgrad=True``, ``capturable=True``,
    ``differentiable=True`` (also per group). ``foreach`` is accepted and changes
    nothing: every step already runs as fused kernels.

    Args:
        params: parameters or param groups (groups may override every option
            below except ``fused``, ``seed``, ``block_size``, ``min_int8_numel``).
        lr: learning rate (>= 0), a float or a 1-element Tensor.
        betas: moment decay rates, each in [0, 1) (floats, or both 1-element Tensors).
        eps: denominator term (> 0).
        weight_decay: decoupled weight decay (>= 0).
        amsgrad: must be False (see above).
        foreach: accepted for torch compatibility (no effect).
        capturable: must be False.
        differentiable: must be False.
        master: how full precision is kept for 16-bit params: ``"auto"``
            (``none`` for fp32 params, ``exact`` for bf16, ``fp32`` for fp16)
            or a registered master format, for the 16-bit parameters; fp32 parameters
            (fp32 islands) are their own master. A master where every parameter
            is fp32 raises (the model was not cast).
        moments: ``"fp32"``, ``"bf16"`` or ``"int8"`` (params with fewer than
            ``min_int8_numel`` elements, or a size that is not a multiple of
            ``block_size``, keep fp32 moments; see `formats`).
        maximize: maximize the objective instead of minimizing.
        fused: ``True`` fuses every step: on CPU with the native C++ kernel
            (`mixprec.optim.native`, built once per machine; fp16 params and
            machines without a compiler use `torch.compile`), elsewhere with
            `torch.compile` (a compile failure raises). ``False`` runs eagerly.
            ``None``: on CPU the native kernel for every group (where it cannot
            run, groups of at least `mixprec.optim.kernels.AUTO_COMPILE_MIN_NUMEL`
            elements compile and smaller ones run eagerly); on CUDA compiled,
            falling back to eager with a `RuntimeWarning` if compilation fails.
            Results are bitwise identical in every mode.
        seed: seed of the stochastic-rounding noise (``None``: read from torch's
            default generator without advancing it, so `torch.manual_seed` makes it
            repeatable and the program's later draws are those it makes with torch's
            AdamW).
        block_size: elements per int8 quantization block.
        min_int8_numel: size below which int8 moments stay fp32.

    Raises:
        ValueError: for a bad hyperparameter, an unknown master or moments
            name, or a master that does not fit a parameter's dtype.
        TypeError: for a ``fused`` that is not a bool or None.
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float | torch.Tensor, float | torch.Tensor] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        master: str = DEFAULT_MASTER,
        moments: str = DEFAULT_MOMENTS,
        seed: int | None = None,
        block_size: int = 256,
        min_int8_numel: int = 4096,
    ) -> None:
        refuse_unsupported(
            "",
            {
                "amsgrad": amsgrad,
                "capturable": capturable,
                "differentiable": differentiable,
                "foreach": foreach,
            },
        )
        check_hyper(lr, betas, eps, weight_decay, foreach=foreach, capturable=capturable)
        if fused is not None and not isinstance(fused, bool):
            raise TypeError(f"fused must be True, False or None, got {fused!r}")
        if block_size < 1 or min_int8_numel < 0:
            raise ValueError(
                f"invalid block_size {block_size!r} / min_int8_numel {min_int8_numel!r}: "
                "need block_size >= 1 and min_int8_numel >= 0"
            )
        self._fused = fused
        self._block_size = block_size
        self._min_int8_numel = min_int8_numel
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, Integral)):
            raise TypeError(f"seed must be an int or None, got {seed!r}")
        if seed is not None and not 0 <= seed < 2**32:
            raise ValueError(
                f"seed must be in [0, 2**32) (the rounding noise is keyed by 32 bits), got {seed}"
            )
        if seed is None:
            # Read from torch's default generator without advancing it: swapping
            # torch.optim.AdamW for this one must not change the program's later random
            # draws (data order, dropout, initialisation).
            with torch.random.fork_rng(devices=[]):
                seed = int(torch.randint(0, 2**31 - 1, (), dtype=torch.int64).item())
        self._seed = int(seed)
        self._plans: dict[torch.Tensor, ParamPlan] = {}
        # The version counter of each parameter's local tensor when its master state was
        # last known to match it (see `_resync_edited`).
        self._versions: dict[torch.Tensor, int] = {}
        # Parameters whose state was loaded since their last step: their next write is
        # taken as the matching model checkpoint of a resume (masters kept where they fit).
        self._restored: set[torch.Tensor] = set()
        # Marked by steps traced by torch.compile (see `_adopt_traced_writes`).
        self._traced_writes: set[bool] = set()
        self._kernels: dict[tuple[str, str, bool, KernelMode], StepKernel] = {}
        # Each group's native step prepared for replay (`mixprec.optim.replay`), by the
        # group's id; whatever changes what a step reads retires them all (`_retire_all`).
        self._prepared: dict[int, PreparedGroup] = {}
        # What the step under way may write (`_reconcile`): a prepared group, or per
        # native batch its parameters, their versions, a step counter and the value it
        # holds once the batch has written; None between steps. Left set by an interrupt.
        self._in_flight: PreparedGroup | list[_BatchWrite] | None = None
        #: What the last `load_state_dict` converted (a torch or older state dict).
        self.last_conversion: StateConversion | None = None
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "amsgrad": amsgrad,
            "maximize": maximize,
            "foreach": foreach,
            "capturable": capturable,
            "differentiable": differentiable,
            "master": master,
            "moments": moments,
        }
        super().__init__(params, defaults)
        self._check_masters_have_16bit_params()

    def _check_masters_have_16bit_params(self) -> None:
        # A master applies to the 16-bit parameters (fp32 ones are their own master); one
        # asked for where every parameter is fp32 means the model was not cast: say so.
        params = [p for g in self.param_groups for p in g["params"]]
        if not params or any(p.dtype != torch.float32 for p in params):
            return
        for group in self.param_groups:
            if group["master"] not in ("auto", "none"):
                master_spec(group["master"]).check_param_dtype(torch.float32)

    # -- construction -----------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group; its formats are resolved now, its state at each parameter's first step."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            self._setup_group(group)
        except BaseException:
            self.param_groups.pop()
            for p in group["params"]:
                self._plans.pop(p, None)
                self.state.pop(p, None)
            raise

    def _setup_group(self, group: dict[str, Any]) -> None:
        refuse_unsupported("param group: ", group)
        check_hyper(
            group["lr"],
            group["betas"],
            group["eps"],
            group["weight_decay"],
            foreach=group.get("foreach"),
            capturable=bool(group.get("capturable")),
        )
        master = group["master"]
        check_master(master, auto=True)  # the registry now: formats registered later too
        check_moments(group["moments"])
        params = group["params"]
        mode = resolve_mode(
            self._fused,
            device_type=params[0].device.type if params else "cpu",
            numel=sum(p.numel() for p in params),
        )
        first_index = len(self._plans)
        for p in params:
            check_param(p)
        refuse_shared_memory([q for g in self.param_groups for q in g["params"]])
        for offset, p in enumerate(params):
            self._plans[p] = plan_param(
                p,
                group,
                mode=mode,
                index=first_index + offset,
                block_size=self._block_size,
                min_int8_numel=self._min_int8_numel,
            )

    def _fresh_state(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        return fresh_state(p, self._plans[p], self._seed)

    def _state_of(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        """`p`'s state, made on first use (as torch's optimizers do: none before a step)."""
        state = self.state.get(p)
        if not state:
            state = self._fresh_state(p)
            self.state[p] = state
            self._versions[p] = sharding.write_version(p)
        return state

    def _kernel(self, plan: ParamPlan, maximize: bool) -> StepKernel:
        key = (plan.master.spec.name, plan.moments.spec.name, maximize, plan.mode)
        kernel = self._kernels.get(key)
        if kernel is None:
            kernel = self._kernels[key] = kernel_for(
                key[0], key[1], maximize=maximize, block_size=self._block_size, mode=plan.mode
            )
        return kernel

    # -- stepping ---------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Apply one AdamW step to every parameter that has a gradient.

        Each group's parameters are stepped by one call per family of formats
        (``torch.ops.mixprec.adamw_step_``): the native CPU kernel runs all of
        them in one pass; step counters are kept on the tensors, with no
        per-parameter host synchronisation.

        Args:
            closure: re-evaluates the model and returns the loss (optional).

        Returns:
            The closure's loss, or None.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        tracing = torch.compiler.is_compiling()
        if tracing:
            # A traced step reads no version counters; its writes (which move them) are
            # ours: `_adopt_traced_writes` tells the eager side so.
            self._traced_writes.add(True)  # a container: torch.compile replays its mutation
        else:
            self._reconcile()
        plans, versions, restored = self._plans, self._versions, self._restored
        state_get = self.state.get
        replayable = not tracing and not ops.observed()
        checked_groups = False  # once per step, before the first group off the replay
        # Every group's options and hyperparameters are checked before any group steps.
        hypers: list[GroupHyper | None] = [None] * len(self.param_groups)
        if not tracing:
            for index, group in enumerate(self.param_groups):
                hypers[index] = _check_group(group, index)
                if group["params"]:
                    try:
                        refuse_unsupported(f"param group {index}: ", group)
                        self._refuse_format_edits(group, index)
                    except ValueError as exc:
                        raise ValueError(f"{exc} (nothing was stepped)") from None
        for index, group in enumerate(self.param_groups):
            if replayable:
                prepared = self._prepared.get(id(group))
                if prepared is not None:
                    hyper = hypers[index]
                    if prepared.group is group and hyper is not None:
                        prepared.arm()
                        self._in_flight = prepared
                        replayed = prepared.replay(group, self.state, hyper)
                        self._in_flight = None
                        if replayed:
                            continue
                    self._retire(prepared)
            # One batch per family, kernel mode, device and round: (a plan of it, the batch).
            # A parameter listed twice in a group (torch warns, and steps it twice in
            # turn) takes its second step in a later round, run after the first: in one
            # batch the kernel would update the same memory from two places at once.
            batches: dict[
                tuple[tuple[str, str, str], torch.device, int], tuple[ParamPlan, StepBatch]
            ]
            batches = {}
            stepped: list[torch.Tensor] = []
            rounds = _repeat_rounds(group["params"])
            if group["params"] and not checked_groups:
                self._refuse_params_in_two_groups()
                checked_groups = True
            for i, p in enumerate(group["params"]):
                grad = p.grad
                if grad is None:
                    continue
                plan = plans.get(p) or self._plan_added_directly(p, group)
                if grad.is_sparse or p.dtype != plan.dtype:
                    self._refuse_step(p, grad, plan)
                state = state_get(p) or self._state_of(p)
                plain = type(p) in _PLAIN
                if not tracing:
                    if (p._version if plain else sharding.write_version(p)) != versions.get(p):
                        self._master_follows_edit(p, plan, state)
                    if restored:
                        restored.discard(p)
                key = (plan.batch_key, p.device, rounds[i] if rounds else 0)
                entry = batches.get(key)
                if entry is None:
                    entry = batches[key] = (plan, StepBatch())
                batch = entry[1]
                if (
                    plain
                    and type(grad) in _PLAIN
                    and p.is_contiguous()
                    and state[plan.element_keys[0]].is_contiguous()
                ):
                    # The common case inline: this runs for every parameter on every step.
                    batch.params.append(p)
                    batch.grads.append(grad if grad.is_contiguous() else grad.contiguous())
                    batch.master_state.extend([state[k] for k in plan.master_keys])
                    batch.moment_state.extend([state[k] for k in plan.moment_keys])
                    batch.steps.append(state["step"])
                    batch.offsets.append(0)  # a whole tensor starts at element 0
                    if plan.uses_noise:
                        batch.seeds.append(state["rng_seed"])
                else:
                    _add_to_batch(batch, p, grad, state, plan)
                stepped.append(p)
            if not batches:
                continue
            hyper = hypers[index] or GroupHyper(  # (traced: not checked ahead)
                lr=scalar(group["lr"]),
                beta1=scalar(group["betas"][0]),
                beta2=scalar(group["betas"][1]),
                eps=float(group["eps"]),
                weight_decay=float(group["weight_decay"]),
            )
            markers: dict[int, torch.Tensor] = {}  # id(batch): its _BatchWrite's marker
            if not tracing:
                # (CPU batches only: the native kernel runs there, and reading a CUDA
                # counter would sync every step.)
                self._in_flight = []
                for _, batch in batches.values():
                    if isinstance(batch.steps[0], torch.Tensor) and batch.steps[0].is_cpu:
                        marker = markers[id(batch)] = version_marker()
                        self._in_flight.append(
                            _BatchWrite(
                                batch.params,
                                [
                                    q._version if type(q) in _PLAIN else sharding.write_version(q)
                                    for q in batch.params
                                ],
                                batch.steps[0],
                                counter_value(batch.steps[0]),
                                marker,
                            )
                        )
            # A Ctrl-C between a native write and its recording below would make the write
            # look like an edit of the user's (see `_reconcile`): held until recorded (not
            # around the portable path, whose first call may compile for a long while).
            hold = not tracing
            if not tracing:  # recorded for kernel_backends() (building one may lock)
                for plan, batch in batches.values():
                    kernel = self._kernel(plan, bool(group["maximize"]))
                    hold = kernel.is_native and hold
                    misfit = kernel.misfit(batch)  # every batch before any steps
                    if misfit is not None:
                        self._in_flight = None
                        raise ValueError(f"param group {index} was not stepped: {misfit}")
            with ctrl_c.held() if hold else contextlib.nullcontext():
                for plan, batch in batches.values():
                    ops.adamw_step_(
                        batch,
                        hyper,
                        master=plan.master.spec.name,
                        moments=plan.moments.spec.name,
                        maximize=bool(group["maximize"]),
                        block_size=self._block_size,
                        mode=plan.mode,
                        marker=markers.get(id(batch)),
                    )
                if not tracing:
                    for p in stepped:
                        versions[p] = p._version if type(p) in _PLAIN else sharding.write_version(p)
                    self._in_flight = None
            if replayable:
                maximize = bool(group["maximize"])
                prepared = prepare_group(
                    group,
                    plans=plans,
                    state=self.state,
                    kernel_of=lambda plan: self._kernel(plan, maximize),  # noqa: B023
                )
                if prepared is not None:
                    self._prepared[id(group)] = prepared
        return loss

    def _retire(self, prepared: PreparedGroup) -> None:
        """Drop a prepared group, recording the versions its replays left (the full path
        reads them from `_versions`)."""
        del self._prepared[id(prepared.group)]
        self._versions.update(prepared.versions())

    def _settle_versions(self) -> None:
        """Record in `_versions` the versions the prepared groups' replays left."""
        for prepared in self._prepared.values():
            self._versions.update(prepared.versions())

    def _retire_all(self) -> None:
        """Drop every prepared group (their state or versions are about to be rewritten)."""
        self._settle_versions()
        self._prepared.clear()

    def _reconcile(self) -> None:
        """Before reading version counters: take in the writes of steps traced by
        torch.compile, of a step that was interrupted (Ctrl-C), and of prepared groups
        whose group dict left `param_groups`.

        A version counter that moved since the optimizer last wrote means an edit to
        follow (`_master_follows_edit`: the master becomes the written value). A step
        interrupted after its native call wrote, before it recorded the versions that
        left, would make its own write look like one. The call is one C call (a
        KeyboardInterrupt is raised between Python operations) that also advances the
        step counters, so a counter that holds its after-value says the call wrote; its
        parameters' version counters then moved by the step's own bump or not yet, which
        a marker bumped with them in the same call says (`replay.version_marker`). An
        edit after the interrupt moves them further, and is followed as usual.
        """
        self._adopt_traced_writes()
        in_flight, self._in_flight = self._in_flight, None
        if isinstance(in_flight, PreparedGroup):
            writes = in_flight.writes()
            if self._prepared.get(id(in_flight.group)) is in_flight:
                self._retire(in_flight)
        else:
            writes = [
                (
                    w.params,
                    w.versions,
                    wrote(w.step_counter, w.step_before),
                    w.marker._version != 0,
                )
                for w in in_flight or ()
            ]
        bumps: dict[torch.Tensor, tuple[int, int]] = {}
        for params, before, written, bumped in writes:
            if written:  # (a parameter listed twice is in two batches: a bump for each)
                for p, v in zip(params, before, strict=True):
                    first, n = bumps.get(p, (v, 0))
                    bumps[p] = (first, n + bumped)
        for p, (before_version, n) in bumps.items():
            now = p._version if type(p) in _PLAIN else sharding.write_version(p)
            if now == before_version + n:  # else edited since: followed at the next step
                self._versions[p] = now
        if self._prepared:
            live = {id(g): g for g in self.param_groups}
            for key, prepared in list(self._prepared.items()):
                if live.get(key) is not prepared.group:  # the group dict was replaced
                    self._retire(prepared)

    def _refuse_params_in_two_groups(self) -> None:
        # `add_param_group` refuses a parameter already in a group; an edit of
        # `param_groups` can still put one in two (a list shared by two groups, say).
        groups = [{id(p) for p in g["params"]} for g in self.param_groups]
        if len(set().union(*groups)) != sum(map(len, groups)):
            raise ValueError(
                "a parameter is in two param groups (param_groups edited directly); an "
                "optimizer steps each parameter in one group"
            )

    def _plan_new_params(self) -> None:
        """Plan every parameter put into `param_groups` by hand since the last look."""
        for group in self.param_groups:
            for p in group["params"]:
                if p not in self._plans:
                    self._plan_added_directly(p, group)

    def _plan_added_directly(self, p: torch.Tensor, group: dict[str, Any]) -> ParamPlan:
        """The plan of a parameter put into ``group["params"]`` by hand (torch's own
        optimizers step such parameters, making their state on first use)."""
        self._refuse_params_in_two_groups()
        check_param(p)
        refuse_shared_memory([q for g in self.param_groups for q in g["params"]])
        self._retire_all()
        self._plans[p] = plan_param(
            p,
            group,
            mode=self._plans[group["params"][0]].mode
            if group["params"][0] in self._plans
            else resolve_mode(self._fused, device_type=p.device.type, numel=p.numel()),
            index=len(self._plans),
            block_size=self._block_size,
            min_int8_numel=self._min_int8_numel,
        )
        self._versions[p] = p._version if type(p) in _PLAIN else sharding.write_version(p)
        return self._plans[p]

    def _adopt_traced_writes(self) -> None:
        """After steps run inside ``torch.compile``, take the parameters' version counters
        as they are: those writes were the optimizer's own, not edits to follow (in-place
        edits between compiled steps are not detected: see docs/optim.md)."""
        if self._traced_writes:
            self._record_versions()
            self._traced_writes.clear()

    def _refuse_format_edits(self, group: dict[str, Any], index: int) -> None:
        # Formats are resolved, and state laid out, when a group is added: an edit of
        # group["master"] / ["moments"] afterwards cannot take effect; say so.
        # (a loop, not next() over a generator: a Ctrl-C in a generator's finalisation
        # is lost)
        for p in group["params"]:
            plan = self._plans.get(p)
            if plan is not None:
                break
        else:
            return  # every parameter was put in by hand: planned with the group's formats
        requested = plan.requested
        if (group["master"], group["moments"]) != requested:
            raise ValueError(
                f"param group {index}: master/moments are {(group['master'], group['moments'])}"
                f" but its parameter {tuple(p.shape)} was planned under {requested} (the "
                "group's formats were edited, or parameters moved between groups, after the "
                "optimizer was built); formats are fixed per group: to change them, build a "
                "new AdamW with the "
                "formats you want, load this one's torch_state_dict() into it (the moments "
                "convert) and then its master_weights() with load_master_weights()"
            )

    @staticmethod
    def _refuse_step(p: torch.Tensor, grad: torch.Tensor, plan: ParamPlan) -> None:
        if grad.is_sparse:
            raise ValueError("mixprec AdamW does not support sparse gradients")
        if p.dtype != plan.dtype:
            raise PrecisionError(
                f"parameter {tuple(p.shape)} was {dtype_name(plan.dtype)} when this "
                f"AdamW was built (master {plan.master.spec.name!r}) and is "
                f"{dtype_name(p.dtype)} now; its master and moments no longer fit: "
                "cast the model (or prec.prepare it) before building the optimizer"
            )

    def _master_follows_edit(
        self, p: torch.Tensor, plan: ParamPlan, state: dict[str, torch.Tensor]
    ) -> None:
        # The parameter was written in place since this optimizer last wrote it (see
        # `mixprec.optim.resync`): after a load of this optimizer's state the write is the
        # resume's model checkpoint (keep the masters that fit); otherwise the master
        # becomes the written value.
        self._retire_all()  # the state is rewritten (and may be replaced)
        lp = sharding.local(p.detach())
        if not sharding.is_dtensor(p):
            _follow_layout(lp, state, plan)
        tensors = [sharding.local(state[k]) for k in plan.master.spec.state_keys]
        for key, tensor in zip(plan.master.spec.state_keys, tensors, strict=True):
            # (`p.set_(t)` of another size bumps the version, unlike `p.data = t`)
            misfit = state_misfit(f"state[{key!r}]", tensor, lp.numel(), None)
            if misfit is not None:
                raise ValueError(f"parameter {tuple(p.shape)}: its {misfit} (not stepped)")
        writes = sharding.write_version(p) - self._versions.get(p, 0)
        if p in self._restored and writes == 1:  # one copy_: the checkpoint's weights
            resync_master(plan.master, lp, tensors)
        else:
            reset_master(plan.master, lp, tensors)
        self._restored.discard(p)
        self._versions[p] = sharding.write_version(p)

    # -- views of the state -----------------------------------------------------------

    @torch.no_grad()
    def sync_edited(self) -> None:
        """Bring the masters of parameters written in place since the last step in line.

        `step`, `master_weights` and `state_dict` call it: after an edit (loading
        weights, re-initialising, pruning, ``zero_()``) a master equals the written
        value; right after `load_state_dict`, a write of the same checkpoint's
        weights keeps the loaded masters (see `mixprec.optim.resync`).
        """
        self._reconcile()
        self._plan_new_params()
        self._settle_versions()
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p)
                if state and sharding.write_version(p) != self._versions.get(p):
                    self._master_follows_edit(p, self._plans[p], state)

    def state_dict(self) -> dict[str, Any]:
        """torch's state dict, with masters first re-synced with edited parameters."""
        self.sync_edited()
        return super().state_dict()

    @torch.no_grad()
    def master_weights(self) -> list[torch.Tensor]:
        """The fp32 master value of every parameter, in parameter order (new tensors).

        Remainder formats are reconstructed; ``kahan`` gives ``param + compensation``;
        ``none`` and ``stochastic`` give the parameter upcast, as does a parameter
        never stepped (it has no state yet). A DTensor parameter gets a DTensor
        sharded like it (``.full_tensor()`` gathers it).
        """
        self.sync_edited()
        out: list[torch.Tensor] = []
        for group in self.param_groups:
            for p in group["params"]:
                plan = self._plans[p]
                lp = sharding.local(p.detach())
                state = self.state.get(p) or plan.master.init_state(lp)
                if self.state.get(p) and not sharding.is_dtensor(p):
                    _follow_layout(lp, state, plan)
                flat_state = [
                    flat_view(sharding.local(state[k])) for k in plan.master.spec.state_keys
                ]
                value = plan.master.decode(flat_view(lp), flat_state).to(torch.float32)
                out_local = torch.empty_like(lp, dtype=torch.float32)
                flat_view(out_local).copy_(value)
                value = out_local
                out.append(sharding.shard_like(value, p, p.shape))
        return out

    @torch.no_grad()
    def load_master_weights(self, weights: Sequence[torch.Tensor]) -> None:
        """Set every parameter and its master from fp32 values: `master_weights` inverted.

        Each parameter becomes its value rounded to the parameter's dtype as its
        master format rounds (``stochastic`` and ``none``: to nearest), and the
        master keeps the rest, so ``master_weights()`` then returns `weights`
        bitwise wherever the format can hold them (``exact``, ``fp32``; ``kahan``
        and ``remainder8`` to within their precision). Used to carry weights across
        master formats (`mixprec.checkpoint.load(convert=True)`).

        Args:
            weights: one tensor per parameter, in `param_groups` order, shaped like it.

        Raises:
            ValueError: a count or a shape differs, or a value is not finite.
        """
        self.sync_edited()
        params = [p for group in self.param_groups for p in group["params"]]
        if len(weights) != len(params):
            raise ValueError(f"got {len(weights)} weights for {len(params)} parameters")
        for i, (p, w) in enumerate(zip(params, weights, strict=True)):
            if tuple(w.shape) != tuple(p.shape):
                raise ValueError(
                    f"weight {i} has shape {tuple(w.shape)}, its parameter {tuple(p.shape)}"
                )
        for p, w in zip(params, weights, strict=True):
            plan = self._plans[p]
            lp = sharding.local(p.detach())
            value = flat_view(like_param(sharding.local(w).to(lp.device, torch.float32), lp))
            if plan.uses_noise or not plan.master_keys:
                flat_view(lp).copy_(value)  # round to nearest: no master to keep the rest
                continue
            stored, kept = plan.master.encode(value, dtype=lp.dtype, noise=None)
            flat_view(lp).copy_(stored)
            state = self.state.get(p)
            if not state:
                if not any(bool(t.any()) for t in kept):
                    continue  # the value fits the parameter: no state needed yet (lazy)
                state = self._state_of(p)
            for key, src in zip(plan.master_keys, kept, strict=True):
                flat_view(sharding.local(state[key])).copy_(src)
        self._record_versions()

    def format_of(self, p: torch.Tensor) -> tuple[str, str]:
        """The effective ``(master, moments)`` of parameter `p`.

        Raises:
            KeyError: `p` is not a parameter of this optimizer.
        """
        plan = self._plans[p]
        return plan.master.spec.name, plan.moments.spec.name

    def formats(self) -> list[tuple[str, str]]:
        """The effective ``(master, moments)`` of every parameter, in parameter order."""
        self._plan_new_params()
        return [
            (self._plans[p].master.spec.name, self._plans[p].moments.spec.name)
            for group in self.param_groups
            for p in group["params"]
        ]

    def kernels_compiled(self) -> dict[str, bool]:
        """For each family stepped so far, whether it runs fused (native or compiled)."""
        out: dict[str, bool] = {}
        for kernel in self._kernels.values():
            out[kernel.family.name] = out.get(kernel.family.name, False) or kernel.is_compiled
        return out

    def kernel_backends(self) -> dict[str, str]:
        """For each family stepped so far, how its groups run: a sorted ``+``-joined
        subset of ``native``, ``compiled`` and ``eager`` (e.g. ``"native"``)."""
        found: dict[str, set[str]] = {}
        for group in self.param_groups:
            for p in group["params"]:
                plan = self._plans.get(p)
                if plan is None or not self.state.get(p):
                    continue  # not stepped yet
                key = (plan.master.spec.name, plan.moments.spec.name, bool(group["maximize"]))
                kernel = self._kernels.get((*key, plan.mode))
                if kernel is not None:
                    found.setdefault(kernel.family.name, set()).add(kernel.backend(p.dtype))
        return {name: "+".join(sorted(hows)) for name, hows in found.items()}

    # -- copies -----------------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        # torch.optim.Optimizer keeps only defaults, state and groups; the formats and
        # options are needed to step. Kernels are a cache, rebuilt on first use.
        out = dict(super().__getstate__())
        for key in ("_fused", "_block_size", "_min_int8_numel", "_seed", "_plans"):
            out[key] = getattr(self, key)
        return out

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._restored = set()
        self._traced_writes = set()
        self.last_conversion = None
        self._kernels = {}
        self._prepared = {}
        self._record_versions()

    def _record_versions(self) -> None:
        self._prepared.clear()  # state or versions rewritten: prepared steps are retired
        self._in_flight = None
        self._versions = {
            p: sharding.write_version(p) for g in self.param_groups for p in g["params"]
        }

    # -- checkpoints ------------------------------------------------------------------

    @torch.no_grad()
    def check_state_dict(self, state_dict: dict[str, Any]) -> StateConversion:
        """Validate `state_dict` as `load_state_dict` would, changing nothing.

        Returns:
            What loading it would convert.

        Raises:
            ValueError: as `load_state_dict`.
        """
        return read_state_dict(
            state_dict, self.param_groups, self._fresh_state, self._formats_of
        ).conversion

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of this optimizer, of an older mixprec version, or of
        `torch.optim.AdamW`, converted to this optimizer's formats.

        Everything is validated before anything changes; saved tensors are copied
        into new ones made like this optimizer's own (dtypes exactly), and a
        parameter with no saved state has none afterwards (as in torch); group
        hyperparameters (lr, betas...) are taken from
        the saved groups, as `torch.optim.Optimizer` does. A torch state dict's
        fp32 moments are encoded into this optimizer's moment formats and its
        masters start equal to the parameters; what was converted is in
        `last_conversion` (``last_conversion.describe()``).

        Raises:
            ValueError: if groups, formats, state keys, shapes or dtypes differ, or
                the torch state uses what this optimizer refuses (AMSGrad, L2 Adam).
        """
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        loaded = read_state_dict(state_dict, self.param_groups, self._fresh_state, self._formats_of)
        for p, new_state in loaded.states.items():
            if new_state is None:
                self.state.pop(p, None)
            else:
                self.state[p] = new_state
        for group, saved in zip(self.param_groups, loaded.groups, strict=True):
            for key, value in saved.items():
                if key != "params":
                    group[key] = tuple(value) if key == "betas" else value
        conversion = loaded.conversion
        self._record_versions()  # the loaded state matches the parameters as they are now
        self._restored = {p for p, st in loaded.states.items() if st is not None}
        self.last_conversion = conversion
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    @torch.no_grad()
    def torch_state_dict(self, *, moments_dtype: torch.dtype | None = None) -> dict[str, Any]:
        """This optimizer's state as `torch.optim.AdamW` saves it, for
        `torch.optim.AdamW.load_state_dict` (moments decoded into the parameters'
        dtype, as torch keeps them, or into `moments_dtype`; masters left out: torch
        keeps none, see `master_weights`)."""
        self.sync_edited()
        return to_torch(self.param_groups, self.state, self._formats_of, moments_dtype)

    def _formats_of(self, p: torch.Tensor) -> tuple[MasterFormat, MomentFormat]:
        plan = self._plans[p]
        return plan.master, plan.moments

    def __repr__(self) -> str:
        kinds = sorted(set(self.formats()))
        groups = len(self.param_groups)
        return f"mixprec.optim.AdamW(formats={kinds}, fused={self._fused!r}, groups={groups})"
