"""Memory and communication accounting: predicted and measured, by component.

"Half the memory" claims fail because they count activations and forget
masters, moments, gradients and communication. `estimate` predicts every
component for a policy; `measure` measures the same components on a real step
by walking the tensors that exist, so the two can be compared.

Components (bytes):

* ``params``: parameter storage in the policy's storage dtype (fp32 islands apart);
* ``fp32_islands``: parameters of modules kept in fp32 (norm layers by default);
* ``grads``: gradients, in the dtype of their parameter;
* ``master``: the optimizer's full-precision representation of 16-bit params
  (fp32 copy, int16/int8 remainders, Kahan compensation);
* ``moments``: optimizer moments, including int8 block scales;
* ``activations``: tensors saved for backward (autocast's 16-bit weight copies
  included, parameters themselves excluded).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal

import torch
from torch import nn

from mixprec.policy import Policy, matches_fp32_module
from mixprec.policy import policy as get_policy

__all__ = [
    "COMPONENTS",
    "Components",
    "MemoryBreakdown",
    "TransformerShape",
    "estimate",
    "measure",
    "optimizer_state_nbytes",
    "saved_activation_bytes",
    "state_nbytes",
]

Sharding = Literal["none", "fsdp", "ddp"]

#: The components, in report order.
COMPONENTS: tuple[str, ...] = (
    "params",
    "fp32_islands",
    "grads",
    "master",
    "moments",
    "activations",
)

_GiB = 2.0**30


@dataclass(frozen=True, kw_only=True)
class Components:
    """Bytes by component; `total` is their sum."""

    params: int = 0
    fp32_islands: int = 0
    grads: int = 0
    master: int = 0
    moments: int = 0
    activations: int = 0

    @property
    def total(self) -> int:
        """The sum of every component."""
        return sum(getattr(self, f.name) for f in fields(self))

    def to_dict(self) -> dict[str, int]:
        """Every component and the total."""
        out = {f.name: int(getattr(self, f.name)) for f in fields(self)}
        out["total"] = self.total
        return out

    def __add__(self, other: Components) -> Components:
        return Components(
            **{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)}
        )


@dataclass(frozen=True, kw_only=True)
class MemoryBreakdown:
    """Predicted or measured memory of one policy, and its communication per step.

    Attributes:
        policy: the policy name.
        params: the number of parameters.
        world_size: ranks the model is spread over.
        sharding: ``none``, ``fsdp`` (FSDP2: params, grads, master and moments
            sharded) or ``ddp`` (replicated).
        bytes: bytes by component over all ranks together (`per_rank` times
            `world_size`; with FSDP2 that is the whole model once, padding included).
        per_rank: bytes one rank holds.
        comm_bytes_per_step: logical payload per step: ``all_gather`` (FSDP2
            parameter all-gathers in the compute dtype, forward and backward),
            ``reduce_scatter`` (FSDP2 gradients in the reduce dtype),
            ``all_reduce`` (DDP gradients in the reduce dtype).
        measured: True for `measure` output, False for `estimate`.
        notes: assumptions worth reading next to the numbers.
    """

    policy: str
    params: int
    world_size: int = 1
    sharding: Sharding = "none"
    bytes: Components
    per_rank: Components
    comm_bytes_per_step: Mapping[str, int] = field(default_factory=dict)
    measured: bool = False
    notes: tuple[str, ...] = ()

    @property
    def state_bytes_per_param(self) -> float:
        """Training-state bytes (everything but activations) per parameter, on one rank
        times the world size for sharded state (i.e. of the whole model once)."""
        per_rank_state = self.per_rank.total - self.per_rank.activations
        copies = self.world_size if self.sharding == "fsdp" else 1
        return per_rank_state * copies / self.params if self.params else 0.0

    def to_dict(self) -> dict[str, Any]:
        """The JSON contract of `mixprec budget --json` (one object per policy)."""
        return {
            "policy": self.policy,
            "params": self.params,
            "world_size": self.world_size,
            "sharding": self.sharding,
            "bytes": self.bytes.to_dict(),
            "per_rank": self.per_rank.to_dict(),
            "comm_bytes_per_step": dict(self.comm_bytes_per_step),
            "measured": self.measured,
            "notes": list(self.notes),
        }


# ------------------------------------------------------------ optimizer state


#: `mixprec.optim.AdamW` defaults for int8 moments: elements per quantization block,
#: and the smallest tensor quantized (smaller ones, and tensors whose size is not a
#: multiple of the block, keep fp32 moments). A test pins these to the optimizer's.
INT8_BLOCK_SIZE = 256
INT8_MIN_NUMEL = 4096

_MASTER_BYTES_PER_ELEMENT = {
    "none": 0,
    "fp32": 4,  # an fp32 copy
    "exact": 2,  # int16 remainder: bf16 + remainder = the fp32 bits
    "remainder8": 1,  # int8 remainder: a 24-bit master
    "kahan": 2,  # bf16 compensation
    "stochastic": 0,  # rounding noise, no state
}


def state_nbytes(
    numel: int,
    *,
    param_dtype: torch.dtype,
    master: str,
    moments: str,
    block_size: int = INT8_BLOCK_SIZE,
    min_int8_numel: int = INT8_MIN_NUMEL,
    quantizable: bool | None = None,
) -> dict[str, int]:
    """Bytes `mixprec.optim.AdamW` keeps for one parameter tensor, by category.

    The formula is the storage formats' documented layout (docs/optim.md), written
    independently of the optimizer code, so `estimate` and `measure` are two
    separate witnesses. Step counters and RNG state are not counted.
    `quantizable` overrides the int8 eligibility rule (for aggregate counts, which
    stand for many large tensors).
    """
    if master not in _MASTER_BYTES_PER_ELEMENT:
        raise ValueError(
            f"unknown master {master!r}; valid: {', '.join(_MASTER_BYTES_PER_ELEMENT)}"
        )
    master_bytes = numel * _MASTER_BYTES_PER_ELEMENT[master]
    if moments == "fp32":
        moment_bytes = 8 * numel
    elif moments == "bf16":
        moment_bytes = 4 * numel
    elif moments == "int8":
        if quantizable is None:
            quantizable = numel >= min_int8_numel and numel % block_size == 0
        if quantizable:
            # int8 exp_avg + uint8 sqrt-coded exp_avg_sq, one fp32 scale per block each.
            moment_bytes = 2 * numel + 2 * 4 * _ceil_div(numel, block_size)
        else:
            moment_bytes = 8 * numel
    else:
        raise ValueError(f"unknown moments {moments!r}; valid: fp32, bf16, int8")
    del param_dtype  # the layout does not depend on it beyond the master choice
    return {"master": master_bytes, "moments": moment_bytes}


def optimizer_state_nbytes(optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of an optimizer's state tensors by category (unique storages).

    Categories: ``master``, ``moments`` and ``other`` (step counters, RNG state).
    `mixprec.optim` optimizers report their own categories; for other optimizers,
    state keys containing ``exp_avg``, ``momentum``, ``square_avg`` or ``sum`` are
    moments, keys containing ``master``, ``remainder`` or ``compensation`` are
    master state, and everything else is other.
    """
    own = getattr(optimizer, "state_nbytes_by_category", None)
    if callable(own):
        result = own()
        return {str(k): int(v) for k, v in result.items()}
    seen: set[int] = set()
    out = {"master": 0, "moments": 0, "other": 0}
    for state in optimizer.state.values():
        for key, value in state.items():
            if not isinstance(value, torch.Tensor):
                continue
            storage = value.untyped_storage()
            ident = storage._cdata
            if ident in seen:
                continue
            seen.add(ident)
            name = str(key)
            if any(k in name for k in ("exp_avg", "momentum", "square_avg", "sum")):
                category = "moments"
            elif any(k in name for k in ("master", "remainder", "compensation")):
                category = "master"
            else:
                category = "other"
            out[category] += storage.nbytes()
    return out


# ---------------------------------------------------------------- activations


def _storage_key(t: torch.Tensor) -> int:
    return int(t.untyped_storage()._cdata)


@contextlib.contextmanager
def _count_saved(exclude: set[int]) -> Iterator[dict[int, int]]:
    """Record unique storages saved for backward (not those in `exclude`) -> nbytes."""
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key not in exclude:
            saved[key] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield saved


def _param_dtype_for(policy: Policy, islands: set[str], name: str) -> torch.dtype:
    return torch.float32 if name in islands else policy.param_dtype


def _island_param_names(model: nn.Module, policy: Policy) -> set[str]:
    """Qualified names of parameters that stay fp32 under `policy`."""
    if policy.param_dtype == torch.float32:
        return set()
    names: set[str] = set()
    for mod_name, module in model.named_modules():
        if matches_fp32_module(policy, mod_name, module):
            for p_name, _ in module.named_parameters():
                names.add(f"{mod_name}.{p_name}" if mod_name else p_name)
    return names


def saved_activation_bytes(
    model: nn.Module,
    inputs: torch.Tensor | Sequence[torch.Tensor],
    *,
    policy: Policy | str,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    targets: Any = None,
    device_type: str = "cpu",
) -> int:
    """Predict the bytes saved for backward by one forward (and loss) under `policy`.

    The forward runs on fake tensors (`torch._subclasses.FakeTensorMode`): shapes
    and dtypes propagate, autocast decides op dtypes exactly as in a real run,
    and no memory is allocated. Parameters take the policy's storage dtypes (fp32
    islands included); the model itself is not changed.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    from mixprec.islands import temporary_fp32_islands

    pol = get_policy(policy)
    islands = _island_param_names(model, pol)
    args = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        params = {
            name: mode.from_tensor(p.detach())
            .to(_param_dtype_for(pol, islands, name) if p.is_floating_point() else p.dtype)
            .requires_grad_(p.requires_grad)
            for name, p in model.named_parameters()
        }
        buffers = {name: mode.from_tensor(b) for name, b in model.named_buffers()}
        fake_args = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)
        fake_targets = mode.from_tensor(targets) if isinstance(targets, torch.Tensor) else targets
        exclude = {_storage_key(t) for t in params.values()}
        autocast: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        if pol.compute_dtype is not None:
            autocast = torch.autocast(device_type=device_type, dtype=pol.compute_dtype)
        with (
            temporary_fp32_islands(model, pol, device_type),
            _count_saved(exclude) as saved,
            autocast,
        ):
            out = torch.func.functional_call(model, {**params, **buffers}, fake_args)
            if loss_fn is not None:
                loss_fn(out, fake_targets)
        return sum(saved.values())


# ----------------------------------------------------------------- transformers


@dataclass(frozen=True, kw_only=True)
class TransformerShape:
    """A decoder-only transformer described by its config (GPT/LLaMA style).

    Attributes:
        n_layer: transformer blocks.
        hidden: model width.
        n_head: attention heads.
        vocab: vocabulary size.
        seq_len: tokens per sequence.
        micro_batch: sequences per rank per step.
        intermediate: MLP width (default 4 x hidden).
        gated_mlp: SwiGLU-style MLP with three matrices (LLaMA) instead of two.
        tied_embeddings: the output head shares the token embedding.
        learned_positions: a learned position embedding (GPT-2) of seq_len rows.
    """

    n_layer: int
    hidden: int
    n_head: int
    vocab: int
    seq_len: int
    micro_batch: int = 1
    intermediate: int | None = None
    gated_mlp: bool = False
    tied_embeddings: bool = True
    learned_positions: bool = False

    def __post_init__(self) -> None:
        for f in ("n_layer", "hidden", "n_head", "vocab", "seq_len", "micro_batch"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{f} must be a positive integer, got {v!r}")
        if self.hidden % self.n_head:
            raise ValueError(f"hidden={self.hidden} is not divisible by n_head={self.n_head}")

    @property
    def ffn(self) -> int:
        """The MLP width."""
        return self.intermediate if self.intermediate is not None else 4 * self.hidden

    def param_counts(self) -> tuple[int, int]:
        """(parameters in 16-bit-eligible matrices and embeddings, parameters in norms)."""
        h, f = self.hidden, self.ffn
        attn = 4 * h * h + 4 * h
        mlp = (3 * h * f) if self.gated_mlp else (2 * h * f + f + h)
        emb = self.vocab * h + (self.seq_len * h if self.learned_positions else 0)
        head = 0 if self.tied_embeddings else self.vocab * h
        norms = self.n_layer * 4 * h + 2 * h
        return self.n_layer * (attn + mlp) + emb + head, norms

    def activation_values(self) -> tuple[int, int]:
        """(values saved in the compute dtype, values saved in fp32) for one micro-batch.

        Per block, with fused attention (no s x s score matrix) and no dropout:
        inputs of the four linear layers and the MLP activation, q/k/v and the
        attention output: ``(10 + 2 * ffn / hidden) * b * s * h`` values (34 b s h
        bytes in 16 bits for ffn = 4h, as in Korthikanti et al. 2022 without the
        dropout masks); the two norm inputs and their statistics in fp32; and the
        logits kept in fp32 by the loss.
        """
        b, s, h, f = self.micro_batch, self.seq_len, self.hidden, self.ffn
        bsh = b * s * h
        per_block = (
            3 * bsh + bsh + bsh + 2 * bsh + (2 if self.gated_mlp else 1) * b * s * f + b * s * f
        )
        compute = self.n_layer * per_block + bsh  # + the head's input
        norm_inputs = (2 * self.n_layer + 1) * (bsh + 2 * b * s)
        logits = 2 * b * s * self.vocab  # fp32 logits and their log-softmax
        return compute, norm_inputs + logits

    @classmethod
    def from_config(
        cls,
        config: Mapping[str, Any],
        *,
        seq_len: int | None = None,
        micro_batch: int | None = None,
    ) -> TransformerShape:
        """Read a transformers-style config (HF ``config.json`` keys or nanoGPT's).

        Accepted keys: ``num_hidden_layers``/``n_layer``, ``hidden_size``/``n_embd``,
        ``num_attention_heads``/``n_head``, ``vocab_size``,
        ``max_position_embeddings``/``block_size``/``seq_len``, ``intermediate_size``,
        ``micro_batch_size``, ``tie_word_embeddings``, ``hidden_act`` (``silu``
        means a gated MLP) and ``model_type``. Nothing is imported.
        """

        def count(key: str, value: Any) -> int:
            # Whole numbers only: a string, a bool, a fraction or a NaN is a broken config.
            ok = isinstance(value, int) and not isinstance(value, bool)
            if isinstance(value, float) and math.isfinite(value) and value.is_integer():
                ok, value = True, int(value)
            if not ok or not 1 <= value <= 10**12:
                raise ValueError(
                    f"config key {key!r} must be a whole number from 1 to 1e12, got "
                    f"{value!r} ({type(value).__name__})"
                )
            return int(value)

        def pick(*keys: str, default: Any = None) -> Any:
            for k in keys:
                if k in config and config[k] is not None:
                    return count(k, config[k])
            if default is None:
                raise ValueError(
                    f"config has none of {list(keys)}; keys present: {sorted(map(str, config))}"
                )
            return default

        model_type = str(config.get("model_type", "")).lower()
        gated = str(config.get("hidden_act", "")).lower() in ("silu", "swiglu") or model_type in (
            "llama",
            "mistral",
            "qwen2",
            "gemma",
            "mixtral",
        )
        return cls(
            n_layer=int(pick("num_hidden_layers", "n_layer", "num_layers")),
            hidden=int(pick("hidden_size", "n_embd", "d_model")),
            n_head=int(pick("num_attention_heads", "n_head")),
            vocab=int(pick("vocab_size")),
            seq_len=int(
                seq_len or pick("seq_len", "max_position_embeddings", "block_size", "n_positions")
            ),
            micro_batch=int(micro_batch or pick("micro_batch_size", default=1)),
            intermediate=count("intermediate_size", config["intermediate_size"])
            if config.get("intermediate_size")
            else None,
            gated_mlp=gated,
            tied_embeddings=bool(config.get("tie_word_embeddings", model_type in ("gpt2", ""))),
            learned_positions=model_type in ("gpt2",)
            or "n_positions" in config
            or "block_size" in config,
        )


# ------------------------------------------------------------------- estimate


def _nbytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class _Tensor:
    """What the estimate knows about one parameter (or an aggregate of many)."""

    numel: int
    rows: int  # size of dim 0: FSDP2 shards along it
    island: bool
    aggregate: bool = False  # a count standing for many large tensors


def _state_for(t: _Tensor, pol: Policy, numel: int) -> Components:
    dtype = torch.float32 if t.island else pol.param_dtype
    master = "none" if dtype == torch.float32 else pol.master
    st = state_nbytes(
        numel,
        param_dtype=dtype,
        master=master,
        moments=pol.moments,
        quantizable=True if t.aggregate else None,
    )
    size = numel * _nbytes(dtype)
    return Components(
        params=0 if t.island else size,
        fp32_islands=size if t.island else 0,
        grads=size,
        master=st["master"],
        moments=st["moments"],
    )


def estimate(
    model: nn.Module | int | float | TransformerShape,
    policy: Policy | str,
    *,
    world_size: int = 1,
    sharding: Sharding = "fsdp",
    inputs: torch.Tensor | Sequence[torch.Tensor] | None = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    targets: Any = None,
    activation_values: float | None = None,
    device_type: str = "cpu",
) -> MemoryBreakdown:
    """Predict memory by component and communication per step for `policy`.

    Args:
        model: an `nn.Module` (exact per-tensor figures), a parameter count, or a
            `TransformerShape` (parameters and activations from the config).
        policy: a `Policy` or preset name.
        world_size: ranks; with ``sharding="fsdp"`` params, grads, master and
            moments are divided among them (FSDP2 shards each tensor along dim 0).
        sharding: ``fsdp`` (FSDP2), ``ddp`` (replicated), or ``none``.
        inputs, loss_fn, targets: an example micro-batch for a module: activations
            are then predicted by a fake-tensor forward (no memory used).
        activation_values: for a parameter count, the number of activation values
            saved for backward; bytes follow the compute dtype (fp32 without autocast).
        device_type: the device type autocast would run on.
    """
    pol = get_policy(policy)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if sharding not in ("none", "fsdp", "ddp"):
        raise ValueError(f"sharding must be one of none, fsdp, ddp; got {sharding!r}")
    if world_size > 1 and sharding == "none":
        raise ValueError("world_size > 1 needs sharding='fsdp' or 'ddp'")
    notes: list[str] = []
    compute_bytes = _nbytes(pol.effective_compute_dtype)
    tensors: list[_Tensor]
    act_rank = 0
    if isinstance(model, nn.Module):
        islands = _island_param_names(model, pol)
        tensors = [
            _Tensor(p.numel(), p.shape[0] if p.dim() else 1, name in islands)
            for name, p in model.named_parameters()
            if p.requires_grad
        ]
        if inputs is not None:
            act_rank = saved_activation_bytes(
                model, inputs, policy=pol, loss_fn=loss_fn, targets=targets, device_type=device_type
            )
        else:
            notes.append("activations not estimated: pass inputs= (and loss_fn=) to include them")
    elif isinstance(model, TransformerShape):
        matrices, norms = model.param_counts()
        tensors = [
            _Tensor(matrices, matrices, False, aggregate=True),
            _Tensor(norms, norms, pol.param_dtype != torch.float32),
        ]
        compute_values, fp32_values = model.activation_values()
        act_rank = compute_values * compute_bytes + fp32_values * 4
        notes.append(
            "transformer parameters are counted as one large tensor per kind; activations assume "
            "fused attention and no dropout"
        )
    else:
        n = int(model)
        if n < 0 or n != model:
            raise ValueError(f"a parameter count must be a non-negative integer, got {model!r}")
        tensors = [_Tensor(n, n, False, aggregate=True)]
        notes.append("a bare parameter count: no fp32 islands, every tensor large")
    if activation_values is not None:
        act_rank = round(activation_values) * compute_bytes
    n_params = sum(t.numel for t in tensors)

    # One rank's state: FSDP2 gives every rank ceil(rows / W) rows of each tensor
    # (padded), DDP and single-device runs hold every tensor whole.
    rank0 = Components(activations=act_rank)
    for t in tensors:
        numel = t.numel
        if sharding == "fsdp" and world_size > 1:
            numel = _ceil_div(t.rows, world_size) * (t.numel // t.rows if t.rows else 0)
        rank0 = rank0 + _state_for(t, pol, numel)
    whole = _times(rank0, world_size)

    comm: dict[str, int] = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
    if world_size > 1:
        reduce_bytes = _nbytes(pol.reduce_dtype)
        if sharding == "fsdp":
            gather_bytes = sum(
                t.numel * (4 if t.island else _nbytes(pol.compute_dtype or pol.param_dtype))
                for t in tensors
            )
            comm["all_gather"] = 2 * gather_bytes  # forward, and again for backward
            comm["reduce_scatter"] = n_params * reduce_bytes
            notes.append("FSDP2 re-gathers parameters for backward (reshard_after_forward=True)")
        else:
            comm["all_reduce"] = n_params * reduce_bytes
    return MemoryBreakdown(
        policy=pol.name,
        params=n_params,
        world_size=world_size,
        sharding=sharding if world_size > 1 else "none",
        bytes=whole,
        per_rank=rank0,
        comm_bytes_per_step=comm,
        measured=False,
        notes=tuple(notes),
    )


def _times(c: Components, k: int) -> Components:
    return Components(**{f.name: getattr(c, f.name) * k for f in fields(c)})


# -------------------------------------------------------------------- measure


def measure(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    step_fn: Callable[[], Any],
    *,
    policy: Policy | str | None = None,
) -> MemoryBreakdown:
    """Measure the components on one real training step.

    `step_fn` runs one full step (forward, loss, backward, optimizer step). During
    it, tensors saved for backward are recorded (unique storages, parameters
    excluded) and each gradient's size is taken as it is accumulated, so
    `zero_grad` inside `step_fn` does not hide them. Afterwards parameters and
    optimizer state are walked (unique storages). On CUDA the peak allocated
    memory of the step is added to the notes.

    Args:
        model: the prepared model.
        optimizer: its optimizer (state is created lazily at the first step, so
            measure a step, not before it).
        step_fn: runs one training step.
        policy: the policy in force (for island classification and the name);
            default: infer nothing about islands and name it ``measured``.
    """
    pol = get_policy(policy) if policy is not None else None
    params = [(n, p) for n, p in model.named_parameters()]
    param_keys = {_storage_key(p) for _, p in params}
    param_keys |= {_storage_key(b) for b in model.buffers()}
    grad_sizes: dict[int, int] = {}
    handles = []
    for _, p in params:
        if p.requires_grad:

            def hook(t: torch.Tensor) -> None:
                if t.grad is not None:
                    grad_sizes[_storage_key(t.grad)] = t.grad.untyped_storage().nbytes()

            handles.append(p.register_post_accumulate_grad_hook(hook))  # type: ignore[no-untyped-call]
    cuda = any(p.is_cuda for _, p in params)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    try:
        with _count_saved(param_keys) as saved:
            step_fn()
    finally:
        for h in handles:
            h.remove()
    islands = _island_param_names(model, pol) if pol is not None else set()
    seen: set[int] = set()
    params_bytes = islands_bytes = 0
    for name, p in params:
        key = _storage_key(p)
        if key in seen:
            continue
        seen.add(key)
        size = p.untyped_storage().nbytes()
        if name in islands:
            islands_bytes += size
        else:
            params_bytes += size
    state = optimizer_state_nbytes(optimizer)
    comps = Components(
        params=params_bytes,
        fp32_islands=islands_bytes,
        grads=sum(grad_sizes.values()),
        master=state.get("master", 0),
        moments=state.get("moments", 0),
        activations=sum(saved.values()),
    )
    notes = [f"optimizer other state: {state.get('other', 0)} bytes (step counters, RNG)"]
    if cuda:
        notes.append(
            f"CUDA peak allocated during the step: {torch.cuda.max_memory_allocated()} bytes"
        )
    return MemoryBreakdown(
        policy=pol.name if pol is not None else "measured",
        params=sum(p.numel() for _, p in params),
        bytes=comps,
        per_rank=comps,
        measured=True,
        notes=tuple(notes),
    )


def format_gib(n: float) -> str:
    """Bytes as GiB with two decimals."""
    return f"{n / _GiB:.2f}"
