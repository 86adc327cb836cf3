"""`AdamW`: a drop-in `torch.optim.AdamW` with explicit master and moment formats.

The class only owns state and calls the pure pieces: formats are resolved once
per parameter when its group is added, state is made at a parameter's first
step (as torch's optimizers do: a frozen parameter never gets any), and each
group's parameters are gathered by format family at the boundaries
(`mixprec.optim.step_batch`), so a step makes one kernel call per family.

One rule follows weights written in place between steps (pruning,
re-initialisation, ``model.load_state_dict``): a parameter whose version counter
moved since the optimizer last wrote it has its master reset from it
(`mixprec.optim.resync`). Loading this optimizer's state records the versions
as they are, so a resume loads the model's weights first, then the optimizer's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from numbers import Integral
from typing import Any

import torch
from torch.optim.optimizer import ParamsT

from mixprec.formats import (
    MasterFormat,
    MomentFormat,
    check_master,
    check_moments,
    master_spec,
)
from mixprec.formats.catalog import DEFAULT_MASTER, DEFAULT_MOMENTS
from mixprec.optim import sharding
from mixprec.optim.kernels import resolve_mode
from mixprec.optim.layout import flat_view, like_param
from mixprec.optim.options import check_hyper, refuse_unsupported
from mixprec.optim.param_plan import (
    ParamPlan,
    check_param,
    fresh_state,
    plan_param,
    refuse_shared_memory,
)
from mixprec.optim.resync import reset_master
from mixprec.optim.state_dicts import StateConversion, read_state_dict, to_torch
from mixprec.optim.step_batch import GroupStep, follow_layout, gather_group, read_hyper

__all__ = ["AdamW"]


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
        # Each group's gathered step (`mixprec.optim.step_batch`), in group order.
        self._steps: list[GroupStep | None] = []
        # Marked by steps traced by torch.compile (see `_adopt_traced_writes`).
        self._traced_writes: set[bool] = set()
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

    # -- construction (the boundaries: everything is checked here) --------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group; its formats are resolved now, its state at each parameter's first step."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            self._setup_group(group)
            self._gather(len(self.param_groups) - 1, at_step=False, fresh=True)
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
        return state

    def _gather(self, index: int, *, at_step: bool, fresh: bool = False) -> GroupStep:
        """Gather group `index` again (`step_batch.gather_group`). `at_step`: make the
        state of parameters with a first gradient; `fresh`: take every version counter
        as it is now (the state was just loaded), else keep those the last step left."""
        group = self.param_groups[index]
        for p in group["params"]:
            if p not in self._plans:
                self._plan_added_directly(p, group)
        self._refuse_params_in_two_groups()
        steps = self._steps
        old = steps[index] if index < len(steps) else None
        versions = (
            {}
            if fresh or old is None
            else dict(zip(map(id, old.params), old.versions, strict=False))
        )
        out = gather_group(
            group,
            index,
            plans=self._plans,
            state=self.state,
            make_state=self._state_of if at_step else None,
            block_size=self._block_size,
            versions=versions,
        )
        steps.extend([None] * (index + 1 - len(steps)))
        steps[index] = out
        return out

    def _gather_all(self) -> None:
        """Gather every group with the version counters as they are (a boundary)."""
        self._steps = []
        for index in range(len(self.param_groups)):
            self._gather(index, at_step=False, fresh=True)

    def _refuse_params_in_two_groups(self) -> None:
        # `add_param_group` refuses a parameter already in a group; an edit of
        # `param_groups` can still put one in two (a list shared by two groups, say).
        groups = [{id(p) for p in g["params"]} for g in self.param_groups]
        if len(set().union(*groups)) != sum(map(len, groups)):
            raise ValueError(
                "a parameter is in two param groups (param_groups edited directly); an "
                "optimizer steps each parameter in one group"
            )

    def _plan_added_directly(self, p: torch.Tensor, group: dict[str, Any]) -> ParamPlan:
        """The plan of a parameter put into ``group["params"]`` by hand (torch's own
        optimizers step such parameters, making their state on first use)."""
        self._refuse_params_in_two_groups()
        check_param(p)
        refuse_shared_memory([q for g in self.param_groups for q in g["params"]])
        first = group["params"][0]
        self._plans[p] = plan_param(
            p,
            group,
            mode=self._plans[first].mode
            if first in self._plans
            else resolve_mode(self._fused, device_type=p.device.type, numel=p.numel()),
            index=len(self._plans),
            block_size=self._block_size,
            min_int8_numel=self._min_int8_numel,
        )
        return self._plans[p]

    # -- stepping ---------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Apply one AdamW step to every parameter that has a gradient.

        Each group's parameters are stepped by one call per family of formats: the
        native CPU kernel runs all of them in one pass; step counters are kept on the
        tensors, with no per-parameter host synchronisation. A step interrupted by an
        exception (or Ctrl-C) is undefined: resume from a checkpoint.

        Args:
            closure: re-evaluates the model and returns the loss (optional).

        Returns:
            The closure's loss, or None.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if torch.compiler.is_compiling():
            self._traced_step()
            return loss
        if self._traced_writes:
            self._adopt_traced_writes()
        observed = (
            torch.autograd.profiler._is_profiler_enabled or torch._C._len_torch_dispatch_stack() > 0
        )
        steps = self._steps
        for index, group in enumerate(self.param_groups):
            gs = steps[index] if index < len(steps) else None
            if gs is None or not gs.current(group):
                gs = self._gather(index, at_step=True)
            params = group["params"]
            if list(map(gs.version_of, params)) != gs.versions:
                self._follow_edits(gs)
            betas = group["betas"]  # (`step_batch.read_hyper`, inline)
            hyper = (
                float(group["lr"]),
                float(betas[0]),
                float(betas[1]),
                float(group["eps"]),
                float(group["weight_decay"]),
            )
            for batch in gs.batches:
                batch.run(hyper, observed)
            gs.versions = list(map(gs.version_of, params))
        return loss

    def _traced_step(self) -> None:
        """The step inside ``torch.compile``: gathered afresh, through the operator (its
        writes, which move the version counters, are adopted by the next eager call)."""
        self._traced_writes.add(True)  # a container: torch.compile replays its mutation
        for index, group in enumerate(self.param_groups):
            gs = gather_group(
                group,
                index,
                plans=self._plans,
                state=self.state,
                make_state=self._state_of,
                block_size=self._block_size,
                versions={},
            )
            hyper = read_hyper(group)
            for batch in gs.batches:
                batch.run_checked([p.grad for p in batch.params], hyper)

    def _adopt_traced_writes(self) -> None:
        """After steps run inside ``torch.compile``, take the parameters' version counters
        as they are: those writes were the optimizer's own, not edits to follow (in-place
        edits between compiled steps are not detected: see docs/optim.md)."""
        if self._traced_writes:
            self._traced_writes.clear()
            self._gather_all()

    def _follow_edits(self, gs: GroupStep) -> None:
        """Reset the master of each parameter of `gs` written in place since the optimizer
        last wrote it (the one rule: see the module)."""
        for p, before in zip(gs.params, gs.versions, strict=True):
            state = self.state.get(p)
            if state and gs.version_of(p) != before:
                plan = self._plans[p]
                lp = sharding.local(p.detach())
                reset_master(plan.master, lp, [sharding.local(state[k]) for k in plan.master_keys])
        gs.versions = list(map(gs.version_of, gs.params))

    # -- views of the state -----------------------------------------------------------

    @torch.no_grad()
    def sync_edited(self) -> None:
        """Bring the masters of parameters written in place since the last step in line.

        `state_dict`, `master_weights` and `torch_state_dict` call it (`step` does the
        same): after an edit (loading weights, re-initialising, pruning, ``zero_()``)
        a master equals the written value.
        """
        self._adopt_traced_writes()
        steps = self._steps
        for index, group in enumerate(self.param_groups):
            gs = steps[index] if index < len(steps) else None
            if gs is None or not gs.current(group):
                gs = self._gather(index, at_step=False)
            if list(map(gs.version_of, group["params"])) != gs.versions:
                self._follow_edits(gs)

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
                    follow_layout(lp, state, plan)
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
        self._gather_all()  # the masters match the parameters as they are now

    def format_of(self, p: torch.Tensor) -> tuple[str, str]:
        """The effective ``(master, moments)`` of parameter `p`.

        Raises:
            KeyError: `p` is not a parameter of this optimizer.
        """
        plan = self._plans[p]
        return plan.master.spec.name, plan.moments.spec.name

    def formats(self) -> list[tuple[str, str]]:
        """The effective ``(master, moments)`` of every parameter, in parameter order."""
        for group in self.param_groups:
            for p in group["params"]:
                if p not in self._plans:
                    self._plan_added_directly(p, group)
        return [
            (self._plans[p].master.spec.name, self._plans[p].moments.spec.name)
            for group in self.param_groups
            for p in group["params"]
        ]

    def kernels_compiled(self) -> dict[str, bool]:
        """For each family stepped so far, whether it runs fused (native or compiled)."""
        out: dict[str, bool] = {}
        for gs in self._steps:
            for batch in gs.batches if gs else ():
                name = batch.family.name
                out[name] = out.get(name, False) or batch.kernel.is_compiled
        return out

    def kernel_backends(self) -> dict[str, str]:
        """For each family stepped so far, how its groups run: a sorted ``+``-joined
        subset of ``native``, ``compiled`` and ``eager`` (e.g. ``"native"``)."""
        found: dict[str, set[str]] = {}
        for gs in self._steps:
            for batch in gs.batches if gs else ():
                hows = found.setdefault(batch.family.name, set())
                hows.update(batch.kernel.backend(p.dtype) for p in batch.params)
        return {name: "+".join(sorted(hows)) for name, hows in found.items()}

    # -- copies -----------------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        # torch.optim.Optimizer keeps only defaults, state and groups; the formats and
        # options are needed to step. The gathered steps are rebuilt (a boundary).
        out = dict(super().__getstate__())
        for key in ("_fused", "_block_size", "_min_int8_numel", "_seed", "_plans"):
            out[key] = getattr(self, key)
        return out

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._traced_writes = set()
        self.last_conversion = None
        self._gather_all()

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
        # The loaded state matches the parameters as they are now (a resume loads the
        # model's weights first); writes from here on are edits to follow.
        self._gather_all()
        self.last_conversion = loaded.conversion
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
