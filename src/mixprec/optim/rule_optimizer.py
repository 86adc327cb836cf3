"""`RuleOptimizer`: what mixprec's optimizers share: state, boundaries and the step.

`AdamW`, `Adam`, `SGD` and `Lion` are this class with torch's signature and checks
and an update rule per group (`mixprec.optim.rules`). It owns state and calls the
pure pieces: formats are resolved per parameter when its group is added, state is
made at a parameter's first step (as in torch), and groups are gathered by format
family at the boundaries (`group_step`), so a step makes one kernel call per
family. One rule follows weights written in place between steps: a parameter whose
version counter moved since the optimizer last wrote it has its master reset from
it (`resync`); `load_state_dict` records the counters as they are, so a resume
loads the model's weights first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.optim.optimizer import ParamsT

from mixprec.optim.group_step import GroupStep, gather_group, traced_step
from mixprec.optim.kernels import resolve_mode
from mixprec.optim.options import check_formats, check_options, refuse_unsupported
from mixprec.optim.param_plan import (
    ParamPlan,
    check_masters_have_16bit_params,
    check_param,
    fresh_state,
    plan_param,
    refuse_params_in_two_groups,
    refuse_shared_memory,
)
from mixprec.optim.param_step import ParamSteps
from mixprec.optim.resync import check_weights, decode_master, encode_master, follow_edits
from mixprec.optim.rules import Rule
from mixprec.optim.state_dicts import StateConversion, read_state_dict, to_torch
from mixprec.optim.step_batch import StepBatch

__all__ = ["RuleOptimizer"]


class RuleOptimizer(torch.optim.Optimizer):
    """An optimizer stepping each param group with an update rule over chosen
    master and moment formats (see the module). Subclasses give torch's signature,
    check a group's hyperparameters (`_check_hyper`) and name the rule its options pick
    (`_rule_for`).

    Args:
        params: parameters or param groups.
        defaults: the group defaults (with ``master``, ``moments`` and ``maximize``).
        fused, seed, block_size, min_int8_numel: as `AdamW` documents them.
    """

    def __init__(
        self,
        params: ParamsT,
        defaults: dict[str, Any],
        *,
        fused: bool | None,
        seed: int | None,
        block_size: int,
        min_int8_numel: int,
    ) -> None:
        seed = check_options(fused, block_size, min_int8_numel, seed)
        self._fused = fused
        self._block_size = block_size
        self._min_int8_numel = min_int8_numel
        self._seed = int(seed)
        self._plans: dict[torch.Tensor, ParamPlan] = {}
        # Each group's gathered step (`mixprec.optim.group_step`), in group order.
        self._steps: list[GroupStep | None] = []
        # Marked by steps traced by torch.compile (see `_adopt_traced_writes`).
        self._traced_writes: set[bool] = set()
        self._param_steps = ParamSteps()  # each parameter's step of its own (`step_param`)
        #: What the last `load_state_dict` converted (a torch or older state dict).
        self.last_conversion: StateConversion | None = None
        super().__init__(params, defaults)
        check_masters_have_16bit_params(self.param_groups)

    def _check_group(self, group: dict[str, Any]) -> None:
        """Refuse a group whose options, hyperparameters or formats cannot be honoured:
        torch's options no rule honours, the subclass's checks (`_check_hyper`), the
        formats."""
        refuse_unsupported("param group: ", group)
        self._check_hyper(group)
        check_formats(group)

    def _check_hyper(self, group: dict[str, Any]) -> None:
        """Torch's checks of the group's hyperparameters (each subclass's own)."""
        raise NotImplementedError

    def rule_of(self, group: dict[str, Any]) -> Rule:
        """The update rule of param group `group`, fixed when the group is added (its
        parameters' plans keep it): options that decide it (``amsgrad``, a momentum or
        none, ``nesterov``) changed later do not change it; a group not added yet (a
        saved one) gets the rule its options pick."""
        for p in group["params"]:
            plan = self._plans.get(p) if isinstance(p, torch.Tensor) else None
            if plan is not None:
                return plan.rule
        return self._rule_for(group)

    def _rule_for(self, group: dict[str, Any]) -> Rule:
        """The update rule a group's options pick (each subclass's own)."""
        raise NotImplementedError

    def _check_saved_group(self, saved: dict[str, Any], index: int) -> None:
        """A group of a state dict being loaded: valid, and stepped by the same rule as
        group `index` (the rule decides the state: ``amsgrad``, momentum, ``nesterov``)."""
        self._check_group(saved)
        ours, theirs = self.rule_of(self.param_groups[index]), self.rule_of(saved)
        if ours is not theirs:
            raise ValueError(
                f"group is {theirs.name} where this optimizer's is {ours.name}: build the "
                "optimizer with the options the state was saved with (amsgrad, momentum, "
                "nesterov, decoupled_weight_decay)"
            )

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
        self._check_group(group)
        self._plan_params(group, group["params"])

    def _plan_params(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        """Plan `params` of `group`: all of them as it is added, or parameters put into
        its ``params`` by hand (torch steps those too, making their state on first use)."""
        for p in params:
            check_param(p)
        refuse_shared_memory([q for g in self.param_groups for q in g["params"]])
        planned = self._plans.get(group["params"][0]) if params else None
        device, numel = params[0].device.type if params else "cpu", sum(map(torch.numel, params))
        mode = (
            planned.mode if planned else resolve_mode(self._fused, device_type=device, numel=numel)
        )
        rule = self.rule_of(group)
        for p in params:
            self._plans[p] = plan_param(
                p,
                group,
                rule=rule,
                mode=mode,
                index=len(self._plans),
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
        """Gather group `index` again (`group_step.gather_group`). `at_step`: make the
        state of parameters with a first gradient; `fresh`: take every version counter
        as it is now (the state was just loaded), else keep those the last step left."""
        group = self.param_groups[index]
        refuse_params_in_two_groups(self.param_groups)
        new = [p for p in group["params"] if p not in self._plans]
        if new:
            self._plan_params(group, new)
        steps = self._steps
        old = steps[index] if index < len(steps) else None
        known = () if fresh or old is None else old.known_versions()
        out = gather_group(
            group,
            index,
            rule=self.rule_of(group),
            plans=self._plans,
            state=self.state,
            make_state=self._state_of if at_step else None,
            block_size=self._block_size,
            versions=dict(known),
        )
        steps.extend([None] * (index + 1 - len(steps)))
        steps[index] = out
        return out

    def _gather_all(self) -> None:
        """Gather every group with the version counters as they are (a boundary)."""
        self._steps = []
        self._param_steps.clear()
        for index in range(len(self.param_groups)):
            self._gather(index, at_step=False, fresh=True)

    # -- stepping ---------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Apply one step to every parameter that has a gradient.

        One call per family of formats and group (the native CPU kernel: one pass);
        step counters stay on the tensors, with no per-parameter host synchronisation.
        A step interrupted by an exception (or Ctrl-C) is undefined: resume from a
        checkpoint.

        Args:
            closure: re-evaluates the model and returns the loss (optional).

        Returns:
            The closure's loss, or None.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if torch.compiler.is_compiling():  # its writes are adopted by the next eager call
            self._traced_writes.add(True)  # a container: torch.compile replays its mutation
            rules = [self.rule_of(group) for group in self.param_groups]
            traced_step(
                self.param_groups, rules, self._plans, self.state, self._state_of, self._block_size
            )
            return loss
        if self._traced_writes:
            self._adopt_traced_writes()
        observed = (
            torch.autograd.profiler._is_profiler_enabled or torch._C._len_torch_dispatch_stack() > 0
        )
        for index, group in enumerate(self.param_groups):
            gs = self._ready(index, group, at_step=True)
            gs.run(gs.rule.read(group), observed)
            gs.versions = list(map(gs.version_of, group["params"]))
        return loss

    @torch.no_grad()
    def step_param(self, p: torch.Tensor) -> None:
        """Step parameter `p` alone with its gradient, now: bitwise what `step` does to it
        (gradient release calls this from `p`'s post-accumulate-grad hook). O(1) a call:
        `p`'s batch of one is made at its first call (its state then, if it has none) and
        kept (`mixprec.optim.param_step`). Raises `KeyError` if `p` is not a parameter here."""
        self._adopt_traced_writes()
        observed = (
            torch.autograd.profiler._is_profiler_enabled or torch._C._len_torch_dispatch_stack() > 0
        )
        self._param_steps.step(self, p, observed)

    def _ready(self, index: int, group: dict[str, Any], *, at_step: bool) -> GroupStep:
        """Group `index`'s batches, gathered again where they no longer describe it, with
        the masters of parameters edited since the last write reset (the one rule)."""
        gs = self._steps[index] if index < len(self._steps) else None
        if gs is None or not gs.current(group):
            gs = self._gather(index, at_step=at_step)
        if list(map(gs.version_of, group["params"])) != gs.versions:
            follow_edits(gs)
        return gs

    def _adopt_traced_writes(self) -> None:
        """After steps run inside ``torch.compile``, take the parameters' version counters
        as they are: those writes were the optimizer's own, not edits to follow (in-place
        edits between compiled steps are not detected: see docs/optim.md)."""
        if self._traced_writes:
            self._traced_writes.clear()
            self._gather_all()

    @torch.no_grad()
    def sync_edited(self) -> None:
        """Reset the masters of parameters written in place since the optimizer last
        wrote them (as `step` does; `state_dict`, `master_weights` and
        `torch_state_dict` call it): a master then equals the written value."""
        self._adopt_traced_writes()
        for index, group in enumerate(self.param_groups):
            self._ready(index, group, at_step=False)

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
        params = [p for group in self.param_groups for p in group["params"]]
        return [decode_master(p, self._plans[p], self.state.get(p)) for p in params]

    @torch.no_grad()
    def load_master_weights(self, weights: Sequence[torch.Tensor]) -> None:
        """Set every parameter and its master from fp32 values: `master_weights` inverted
        (`resync.encode_master`; bitwise for ``exact`` and ``fp32``). Used to carry
        weights across master formats (`mixprec.checkpoint.load(convert=True)`).

        Args:
            weights: one tensor per parameter, in `param_groups` order, shaped like it.

        Raises:
            ValueError: a count or a shape differs, or a value is not finite.
        """
        self.sync_edited()
        params = [p for group in self.param_groups for p in group["params"]]
        check_weights(params, weights)
        for p, w in zip(params, weights, strict=True):
            encode_master(p, self._plans[p], w, self.state.get(p), self._state_of)
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
            new = [p for p in group["params"] if p not in self._plans]
            if new:
                self._plan_params(group, new)
        return [
            (self._plans[p].master.spec.name, self._plans[p].moments.spec.name)
            for group in self.param_groups
            for p in group["params"]
        ]

    def kernels_compiled(self) -> dict[str, bool]:
        """For each family stepped so far, whether it runs fused (native or compiled)."""
        out: dict[str, bool] = {}
        for b in self._batches():
            out[b.family.name] = out.get(b.family.name, False) or b.kernel.is_compiled
        return out

    def kernel_backends(self) -> dict[str, str]:
        """For each family stepped so far, how its groups run: a sorted ``+``-joined
        subset of ``native``, ``compiled`` and ``eager`` (e.g. ``"native"``)."""
        found: dict[str, set[str]] = {}
        for b in self._batches():
            found.setdefault(b.family.name, set()).update(
                b.kernel.backend(p.dtype) for p in b.params
            )
        return {name: "+".join(sorted(hows)) for name, hows in found.items()}

    def _batches(self) -> list[StepBatch]:
        return [batch for gs in self._steps if gs for batch in gs.batches]

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
        self._param_steps = ParamSteps()
        self.last_conversion = None
        self._gather_all()

    @torch.no_grad()
    def check_state_dict(self, state_dict: dict[str, Any]) -> StateConversion:
        """What loading `state_dict` would convert, changing nothing (raises
        `ValueError` as `load_state_dict` would)."""
        return read_state_dict(
            state_dict,
            self.param_groups,
            self._fresh_state,
            self._plans.__getitem__,
            self._check_saved_group,
        ).conversion

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of this optimizer, of an older mixprec version, or of the
        torch optimizer its rule replaces (`state_dicts.TORCH_FORMS`), converted to this
        optimizer's formats.

        Everything is validated before anything changes; saved tensors are copied
        into new ones made like this optimizer's own, a parameter with no saved state
        has none afterwards and group hyperparameters are the saved ones (as in
        torch). A torch state dict's moments are encoded into this optimizer's
        formats, its masters start equal to the parameters (`last_conversion` says
        what was converted). Load the model's weights first (see the module).

        Raises:
            ValueError: if groups, formats, state keys, shapes or dtypes differ, or
                the torch state is another optimizer's (another rule: AMSGrad where this
                group has none, L2 Adam into AdamW, SGD into Adam).
        """
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        loaded = read_state_dict(
            state_dict,
            self.param_groups,
            self._fresh_state,
            self._plans.__getitem__,
            self._check_saved_group,
        )
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
        """This optimizer's state as the torch optimizer it replaces saves it
        (`state_dicts.TORCH_FORMS`), for its ``load_state_dict`` (moments decoded into
        the parameters' dtype, as torch keeps them, or into `moments_dtype`; masters
        left out: torch keeps none, see `master_weights`)."""
        self.sync_edited()
        return to_torch(self.param_groups, self.state, self._plans.__getitem__, moments_dtype)

    def __repr__(self) -> str:
        kinds = sorted(set(self.formats()))
        groups = len(self.param_groups)
        name = f"mixprec.optim.{type(self).__name__}"
        return f"{name}(formats={kinds}, fused={self._fused!r}, groups={groups})"
