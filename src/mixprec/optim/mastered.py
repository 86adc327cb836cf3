"""`Mastered`: an unmodified torch optimizer stepping fp32 values decoded from a compact master.

The inner optimizer (``torch.optim.Muon``, ``SGD``, ``Adafactor``, ...) is built over
one fp32 "shadow" tensor per parameter, each keeping its identity for the life of the
optimizer, so the inner ``state`` and ``state_dict`` are torch's own, as on fp32
parameters. Between steps a shadow holds no memory (a zero-stride view of one element).
A step takes the parameters with a gradient in order, in chunks whose fp32 scratch
(decoded values plus upcast gradients) fits ``scratch_bytes``; for each chunk it points
every shadow at its parameter's decoded master (``set_``), gives it the gradient in
fp32, calls ``inner.step()`` with only that chunk's shadows holding a gradient (torch's
per-parameter optimizers skip parameters whose ``grad`` is None), then encodes each
result back into the master and the 16-bit parameter. The chunks take turns in one
scratch buffer, released at the end of the step. An
fp32 parameter (an fp32 island) is its own master: its shadow is the parameter's own
memory, and its gradient is used as it is.

Masters are the formats of `mixprec.formats.masters`, decoded and encoded by the native
CPU kernel's codec where it applies (`codec_of`), else by the formats' pure ``decode``
and ``encode`` (bitwise the same); the one edit rule of `mixprec.optim.AdamW` holds
here too: a parameter whose version counter moved, or whose storage was replaced,
since the optimizer last wrote it has its master reset from it
(`resync.reset_master`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.optim.optimizer import ParamsT

from mixprec.dtypes import dtype_name
from mixprec.formats import (
    MasterFormat,
    check_master,
    master_state_keys,
    resolve_master,
)
from mixprec.formats.registry import DEFAULT_MASTER
from mixprec.optim import master_codec, sharding
from mixprec.optim.master_codec import CODECS, Codec
from mixprec.optim.param_plan import check_masters_have_16bit_params
from mixprec.optim.resync import check_weights, reset_master

__all__ = ["DEFAULT_SCRATCH_BYTES", "Mastered"]

#: The default fp32 scratch budget of one chunk (values plus gradients): 256 MiB.
DEFAULT_SCRATCH_BYTES = 256 * 2**20

_NOT_HYPER = frozenset({"params", "param_names", "master"})


class Mastered(torch.optim.Optimizer):
    """Any per-parameter torch optimizer over 16-bit parameters with a compact master.

    ``Mastered(torch.optim.Muon, params, master="exact", lr=0.02)`` steps an
    unmodified ``torch.optim.Muon`` on the fp32 values decoded from each parameter's
    master and writes the result back into the master and the bf16 parameter. With
    ``master="exact"`` over bf16 parameters the masters equal, bit for bit, the
    parameters of the same torch optimizer on fp32 parameters given the same
    gradients. `param_groups` are the real parameters with the inner optimizer's
    hyperparameters (LR schedulers, clipping and `mixprec.Precision` see a usual
    optimizer); they are copied into the inner optimizer's groups at each step.

    A step goes chunk by chunk through its fp32 scratch: the parameters with a
    gradient, in order, grouped so that each chunk's decoded values and upcast
    gradients (4 bytes each per element, none for fp32 parameters and fp32
    gradients) fit ``scratch_bytes``; one buffer per step, as large as the largest
    chunk, serves every chunk in turn and is released at the end of the step. A
    single parameter larger than the budget is a chunk of its own, so the peak is
    ``max(scratch_bytes, 8 * largest numel)``, plus the inner optimizer's own
    temporaries (and, where the eager codec runs, its temporaries for one
    parameter). The inner optimizer's state is its own, fp32 as on fp32
    parameters, and persistent.

    Args:
        optimizer_cls: a ``torch.optim.Optimizer`` subclass that updates each
            parameter from its own gradient and state (every torch optimizer but
            ``LBFGS``, which is refused).
        params: parameters or param groups (a group may name its own ``master``).
        master: the master format of the 16-bit parameters (``"auto"``: ``exact``
            for bf16, ``fp32`` for fp16; see `mixprec.formats`); fp32 parameters
            are their own master (``none``). ``stochastic`` is refused.
        scratch_bytes: the fp32 scratch budget of one chunk; None: one chunk.
        codec: how masters are decoded and encoded (bitwise the same every way).
            ``"auto"``: the native CPU kernel's codec (one parallel pass, written
            straight into the scratch) for plain contiguous CPU bf16 parameters
            of a master it has a code for, else the formats' eager torch code
            (about 20 elementwise passes per parameter). ``"compiled"``: each
            master's decode and encode as one ``torch.compile`` (Inductor) kernel
            everywhere, for CUDA parameters (the first step compiles, seconds;
            on CPU ``"auto"`` is faster). ``"eager"``: the formats' torch code
            everywhere (the reference).
        **kwargs: the inner optimizer's arguments (``lr``, ``momentum``, ...).

    Raises:
        TypeError: `optimizer_cls` is not a ``torch.optim.Optimizer`` subclass.
        ValueError: ``LBFGS``, ``capturable=True`` or ``differentiable=True``; a
            DTensor, complex or float64 parameter; a master that does not fit a
            parameter's dtype; a bad ``scratch_bytes``.
    """

    def __init__(
        self,
        optimizer_cls: type[torch.optim.Optimizer],
        params: ParamsT,
        *,
        master: str = DEFAULT_MASTER,
        scratch_bytes: int | None = DEFAULT_SCRATCH_BYTES,
        codec: Codec = "auto",
        **kwargs: Any,
    ) -> None:
        _check_class(optimizer_cls)
        bad_int = isinstance(scratch_bytes, bool) or not isinstance(scratch_bytes, int)
        if scratch_bytes is not None and (bad_int or scratch_bytes < 1):
            raise ValueError(
                f"scratch_bytes={scratch_bytes!r}: give a positive number of bytes, or None "
                "(one chunk: the whole model's fp32 values and gradients at once)"
            )
        if codec not in CODECS:
            raise ValueError(f"codec={codec!r}: give one of {', '.join(map(repr, CODECS))}")
        _refuse_options(kwargs, "")
        check_master(master, auto=True)
        self._cls = optimizer_cls
        self._kwargs = kwargs
        self._scratch_bytes = scratch_bytes
        self._codec = codec
        self._inner: torch.optim.Optimizer | None = None
        self._masters: dict[torch.Tensor, MasterFormat] = {}
        self._shadows: dict[torch.Tensor, torch.Tensor] = {}
        # (version counter, data pointer) of each parameter when the optimizer last wrote it.
        self._written: dict[torch.Tensor, tuple[int, int]] = {}
        super().__init__(params, {"master": master})
        check_masters_have_16bit_params(self.param_groups)

    @property
    def inner(self) -> torch.optim.Optimizer:
        """The torch optimizer stepping the fp32 shadows (its state is torch's own)."""
        assert self._inner is not None
        return self._inner

    # -- construction (everything is checked here) --------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group: its masters are resolved, the inner optimizer gets its shadows."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            self._add_inner(group)
        except BaseException:
            self.param_groups.pop()
            for p in group["params"]:
                for table in (self._masters, self._shadows):
                    table.pop(p, None)
            raise

    def _add_inner(self, group: dict[str, Any]) -> None:
        where = f"param group {len(self.param_groups) - 1}: "
        check_master(group["master"], auto=True)
        for p in group["params"]:
            self._masters[p] = _plan(p, group["master"])
        shadows = [_parked(p.shape, p.device) for p in group["params"]]
        self._shadows.update(zip(group["params"], shadows, strict=True))
        names = group.get("param_names")
        inner_group = {k: v for k, v in group.items() if k not in _NOT_HYPER}
        inner_group["params"] = list(zip(names, shadows, strict=True)) if names else shadows
        if self._inner is None:
            self._inner = self._cls([inner_group], **self._kwargs)
            self.defaults.update(self._inner.defaults)
        else:
            self._inner.add_param_group(inner_group)
        for key, value in self._inner.param_groups[-1].items():
            if key not in _NOT_HYPER:
                group.setdefault(key, value)
        _refuse_options(group, where)

    # -- stepping ----------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Step the inner optimizer on every parameter with a gradient, chunk by chunk.

        A step interrupted by an exception is undefined (some chunks applied): resume
        from a checkpoint.

        Args:
            closure: re-evaluates the model and returns the loss (optional; called
                once, before the update).

        Returns:
            The closure's loss, or None.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        inner = self.inner
        for group, inner_group in zip(self.param_groups, inner.param_groups, strict=True):
            if len(group["params"]) != len(inner_group["params"]):
                raise ValueError(
                    "a param group's params were edited in place; add parameters with "
                    "add_param_group"
                )
            for key in inner_group:
                if key not in _NOT_HYPER:
                    inner_group[key] = group[key]
        self.sync_edited()
        with_grad = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        chunks = list(self._chunks(with_grad))
        scratch = _scratch(chunks)
        for chunk in chunks:
            used = dict.fromkeys(scratch, 0)
            try:
                for p in chunk:
                    self._load(p, scratch, used)
                inner.step()
                for p in chunk:
                    self._store(p)
            finally:
                for p in chunk:
                    shadow = self._shadows[p]
                    shadow.grad = None
                    _point(shadow, _parked(p.shape, p.device))
        return loss

    def _chunks(self, params: list[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
        """`params` in order, in runs whose fp32 scratch fits the budget (a parameter
        over it alone)."""
        budget = self._scratch_bytes
        chunk: list[torch.Tensor] = []
        used = 0
        for p in params:
            cost = scratch_bytes_of(p)
            if chunk and budget is not None and used + cost > budget:
                yield chunk
                chunk, used = [], 0
            chunk.append(p)
            used += cost
        if chunk:
            yield chunk

    def _load(
        self,
        p: torch.Tensor,
        scratch: dict[torch.device, torch.Tensor],
        used: dict[torch.device, int],
    ) -> None:
        """Point `p`'s shadow at its decoded master and give it the fp32 gradient, each
        (unless `p` or its gradient is fp32) the next free run of `scratch` on its
        device (`used`: how much of each buffer this chunk took)."""

        def take() -> torch.Tensor:
            start = used[p.device]
            used[p.device] = start + _aligned(p.numel())
            return scratch[p.device][start : start + p.numel()].view(p.shape)

        shadow = self._shadows[p]
        grad = p.grad
        assert grad is not None
        if p.dtype == torch.float32:
            _point(shadow, p.detach())  # its own master: stepped in place
        else:
            value = take()
            self._decode(p, self._master_state(p), value)
            _point(shadow, value)
        shadow.grad = grad if grad.dtype == torch.float32 else take().copy_(grad)

    def _store(self, p: torch.Tensor) -> None:
        if p.dtype != torch.float32:
            self._encode(p, self._shadows[p].detach())

    def _master_state(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        """`p`'s master state, made (equal to `p`) on first use."""
        state = self.state.get(p)
        if not state and self._masters[p].spec.state_keys:
            state = self._masters[p].init_state(p.detach())
            self.state[p] = state
        return state or {}

    def codec_of(self, p: torch.Tensor) -> str:
        """What decodes and encodes parameter `p`'s master now: ``"native"`` (the
        native CPU kernel), ``"compiled"`` or ``"eager"`` (`codec`), or ``"none"``
        (an fp32 parameter is its own master).

        Raises:
            KeyError: `p` is not a parameter of this optimizer.
        """
        if p.dtype == torch.float32:
            return "none"
        return master_codec.backend(self._masters[p], p.detach(), self._codec)

    def _decode(
        self, p: torch.Tensor, state: dict[str, torch.Tensor] | None, out: torch.Tensor
    ) -> None:
        """Decode `p`'s master (`state`; None or empty: equal to `p`) into fp32 `out`."""
        fmt = self._masters[p]
        if not state:
            state = fmt.init_state(p.detach())
        tensors = [state[k] for k in fmt.spec.state_keys]
        master_codec.decode(fmt, p.detach(), tensors, out, self.codec_of(p))

    def _encode(self, p: torch.Tensor, value: torch.Tensor) -> None:
        fmt = self._masters[p]
        state = self._master_state(p)
        tensors = [state[k] for k in fmt.spec.state_keys]
        master_codec.encode(fmt, p.detach(), tensors, value, self.codec_of(p))
        self._written[p] = _written(p)

    @torch.no_grad()
    def sync_edited(self) -> None:
        """Reset the master of each parameter written in place since the optimizer last
        wrote it (`step`, `state_dict` and `master_weights` call it)."""
        for p, state in self.state.items():
            if state and self._written.get(p) != _written(p):
                fmt = self._masters[p]
                reset_master(fmt, p.detach(), [state[k] for k in fmt.spec.state_keys])
                self._written[p] = _written(p)

    # -- masters, formats, state dicts --------------------------------------------------

    @torch.no_grad()
    def master_weights(self) -> list[torch.Tensor]:
        """The fp32 master value of every parameter, in parameter order (new tensors)."""
        self.sync_edited()
        out = []
        for p in self._params():
            if p.dtype == torch.float32:
                out.append(p.detach().clone())
            else:
                out.append(torch.empty(p.shape, dtype=torch.float32, device=p.device))
                self._decode(p, self.state.get(p), out[-1])
        return out

    @torch.no_grad()
    def load_master_weights(self, weights: Sequence[torch.Tensor]) -> None:
        """Set every parameter and its master from fp32 values: `master_weights` inverted
        (bitwise for ``exact`` and ``fp32``).

        Raises:
            ValueError: a count or a shape differs.
        """
        self.sync_edited()
        params = self._params()
        check_weights(params, weights)
        for p, w in zip(params, weights, strict=True):
            value = w.detach().to(p.device, torch.float32)
            if p.dtype == torch.float32:
                p.copy_(value)
            else:
                self._encode(p, value)

    def format_of(self, p: torch.Tensor) -> tuple[str, str]:
        """``(master, "inner")`` of parameter `p`: its master format, and state kept by
        the inner optimizer (fp32, as on fp32 parameters).

        Raises:
            KeyError: `p` is not a parameter of this optimizer.
        """
        return self._masters[p].spec.name, "inner"

    def formats(self) -> list[tuple[str, str]]:
        """`format_of` every parameter, in parameter order."""
        return [self.format_of(p) for p in self._params()]

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def state_dict(self) -> dict[str, Any]:
        """torch's form: per parameter, the inner optimizer's state and the master's
        state keys (masters first re-synced with edited parameters)."""
        self.sync_edited()
        outer = super().state_dict()
        inner = self.inner.state_dict()["state"]
        state: dict[int, dict[str, Any]] = {}
        for index in sorted({*outer["state"], *inner}):
            mine, theirs = outer["state"].get(index, {}), inner.get(index, {})
            clash = sorted(set(mine) & set(theirs))
            if clash:
                raise ValueError(
                    f"{self._cls.__name__} keeps state keys {clash}, which the master also "
                    "uses: its state cannot be saved beside the master's"
                )
            state[index] = {**theirs, **mine}
        return {"state": state, "param_groups": outer["param_groups"]}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of this optimizer (or of the inner optimizer class on the
        same parameters: masters then start equal to the parameters). Saved tensors are
        copied; everything is checked before anything changes. Load the model's
        weights first: the masters follow the parameters as they are now.

        Raises:
            ValueError: groups, parameters, master formats or state shapes differ.
        """
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        groups = state_dict["param_groups"]
        sizes = [len(g["params"]) for g in groups]
        if sizes != [len(g["params"]) for g in self.param_groups]:
            raise ValueError(
                f"the state dict's param groups hold {sizes} parameters, this optimizer's "
                f"{[len(g['params']) for g in self.param_groups]}"
            )
        for i, (saved, group) in enumerate(zip(groups, self.param_groups, strict=True)):
            if saved.get("master", group["master"]) != group["master"]:
                raise ValueError(
                    f"param group {i} was saved with master={saved['master']!r}, this "
                    f"optimizer keeps {group['master']!r}: build it with the run's master"
                )
        param_of = dict(zip([i for g in groups for i in g["params"]], self._params(), strict=True))
        masters: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        inner_state: dict[Any, dict[str, Any]] = {}
        for index, entry in state_dict["state"].items():
            if index not in param_of:
                raise ValueError(f"the state dict holds state for unknown parameter {index!r}")
            p = param_of[index]
            masters[p] = _read_master(p, self._masters[p], entry, index)
            rest = {k: v for k, v in entry.items() if k not in masters[p]}
            if rest:
                inner_state[index] = copy.deepcopy(rest)
        inner_groups = [{k: v for k, v in g.items() if k != "master"} for g in groups]
        self.inner.load_state_dict({"state": inner_state, "param_groups": inner_groups})
        self.state.clear()
        self.state.update({p: s for p, s in masters.items() if s})
        for group, saved in zip(self.param_groups, groups, strict=True):
            group.update({k: v for k, v in saved.items() if k not in _NOT_HYPER})
        self._written = {p: _written(p) for p in self._params()}
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def __getstate__(self) -> dict[str, Any]:
        out = dict(super().__getstate__())
        keys = ("_cls", "_kwargs", "_scratch_bytes", "_codec", "_inner", "_masters")
        for key in (*keys, "_shadows"):
            out[key] = getattr(self, key)
        return out

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        # A copy's masters match its parameters as they are (a boundary, as after a load).
        self._written = {p: _written(p) for p in self._params()}

    def __repr__(self) -> str:
        kinds = sorted({name for name, _ in self.formats()})
        name = f"{self._cls.__module__}.{self._cls.__qualname__}"
        return (
            f"mixprec.optim.Mastered({name}, masters={kinds}, "
            f"scratch_bytes={self._scratch_bytes!r}, codec={self._codec!r}, "
            f"groups={len(self.param_groups)})"
        )


def _aligned(numel: int) -> int:
    """`numel` rounded up to 16 elements: each run of the scratch starts on 64 bytes."""
    return -(-numel // 16) * 16


def _scratch(chunks: list[list[torch.Tensor]]) -> dict[torch.device, torch.Tensor]:
    """A step's fp32 scratch: per device, one buffer as large as the largest chunk's
    runs there (`scratch_bytes_of`), which every chunk reuses, so its pages are first
    touched once per step rather than once per chunk (the peak is the same)."""
    need: dict[torch.device, int] = {}
    for chunk in chunks:
        per_device: dict[torch.device, int] = {}
        for p in chunk:
            runs = scratch_bytes_of(p) // (4 * max(p.numel(), 1))
            per_device[p.device] = per_device.get(p.device, 0) + runs * _aligned(p.numel())
        for device, n in per_device.items():
            need[device] = max(need.get(device, 0), n)
    return {d: torch.empty(n, dtype=torch.float32, device=d) for d, n in need.items()}


def scratch_bytes_of(p: torch.Tensor) -> int:
    """The fp32 scratch a step of `p` (with its gradient) allocates: its decoded value
    unless it is fp32, its upcast gradient unless that is fp32."""
    grad = p.grad
    per_element = (4 if p.dtype != torch.float32 else 0) + (
        4 if grad is not None and grad.dtype != torch.float32 else 0
    )
    return per_element * p.numel()


def _check_class(cls: object) -> None:
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TypeError(
            f"Mastered takes a torch.optim.Optimizer subclass (e.g. torch.optim.SGD), got "
            f"{cls!r}; pass the class itself, and its arguments as keywords"
        )
    if issubclass(cls, torch.optim.LBFGS):
        raise ValueError(
            "torch.optim.LBFGS is not per-parameter (its line search and history span every "
            "parameter at once) and cannot be stepped in chunks; use LBFGS on fp32 parameters"
        )
    if issubclass(cls, Mastered):
        raise ValueError("Mastered over Mastered: give the torch optimizer class itself")
    from mixprec.optim.rule_optimizer import RuleOptimizer

    if issubclass(cls, RuleOptimizer):
        raise ValueError(
            f"mixprec.optim.{cls.__name__} keeps its own master and moment formats: use it "
            f"directly (mixprec.optim.{cls.__name__}(params, master=...)); Mastered is for "
            "torch optimizers mixprec has no class for (Muon, Adafactor, RMSprop, ...)"
        )


def _refuse_options(options: dict[str, Any], where: str) -> None:
    for key in ("capturable", "differentiable"):
        if options.get(key):
            raise ValueError(
                f"{where}{key}=True: Mastered steps scratch copies outside any CUDA graph "
                f"or autograd graph; leave {key}=False (or use the optimizer on fp32 "
                "parameters directly)"
            )


def _plan(p: torch.Tensor, requested: str) -> MasterFormat:
    """`p`'s master format (fp32 parameters are their own master), refusing what the
    step cannot do."""
    shape = tuple(p.shape)
    if sharding.is_dtensor(p):
        raise ValueError(
            f"parameter {shape} is a DTensor (FSDP2 or tensor parallel): Mastered does not "
            "support sharded parameters yet; use mixprec.optim.AdamW, which steps shards"
        )
    if not p.is_floating_point() or p.dtype == torch.float64:
        raise ValueError(
            f"parameter {shape} is {dtype_name(p.dtype)}: Mastered steps fp32 values decoded "
            "from bf16/fp16/fp32 parameters; use the torch optimizer directly on complex "
            "or fp64 parameters"
        )
    fmt = resolve_master("none" if p.dtype == torch.float32 else requested, p.dtype)
    if fmt.spec.uses_noise:
        raise ValueError(
            f"master={fmt.spec.name!r} draws rounding noise per step, which Mastered does "
            "not; use master='exact' (bf16) or 'kahan'"
        )
    return fmt


def _parked(shape: torch.Size, device: torch.device) -> torch.Tensor:
    """An fp32 tensor of `shape` over one element (zero strides): a shadow between steps."""
    one = torch.zeros(1, device=device).untyped_storage()
    return torch.empty(0, device=device).set_(one, 0, tuple(shape), (0,) * len(shape))


def _point(shadow: torch.Tensor, t: torch.Tensor) -> None:
    """Make `shadow` a view of `t`'s memory (``shadow.set_(t)``)."""
    shadow.set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride())


def _written(p: torch.Tensor) -> tuple[int, int]:
    return sharding.write_version(p), p.data_ptr()


def _read_master(
    p: torch.Tensor, fmt: MasterFormat, entry: dict[str, Any], index: object
) -> dict[str, torch.Tensor]:
    """The master state of saved `entry`, checked and copied (empty: none saved)."""
    keys = fmt.spec.state_keys
    found = sorted(k for k in entry if k in master_state_keys())
    if not found:
        return {}
    if found != sorted(keys):
        raise ValueError(
            f"parameter {index!r} was saved with master state {found}, this optimizer keeps "
            f"{list(keys)} (master {fmt.spec.name!r}): build it with the run's master"
        )
    fresh = fmt.init_state(p.detach())
    for key in keys:
        saved = entry[key]
        if not isinstance(saved, torch.Tensor) or (saved.shape, saved.dtype) != (
            fresh[key].shape,
            fresh[key].dtype,
        ):
            raise ValueError(
                f"parameter {index!r}: saved {key} does not match a {fmt.spec.name!r} master "
                f"of shape {tuple(p.shape)} ({fresh[key].dtype})"
            )
        fresh[key].copy_(saved)
    return fresh
