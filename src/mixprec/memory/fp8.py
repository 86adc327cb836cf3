"""FP8 linears in the memory accounting: what torchao saves for backward, and the casts'
temporaries, predicted per layer and measured on a real step.

What torchao 0.18's float8 training holds (``torchao/float8/float8_linear.py``,
``float8_utils.py``, ``float8_ops.py``, read for this module):

* **Saved for backward**: ``matmul_with_hp_or_float8_args`` saves ``input_hp`` and
  ``weight_hp_t``, the high-precision input and (a view of) the weight, and casts them
  again in backward. A converted layer saves exactly what a 16-bit ``nn.Linear`` under
  autocast saves: FP8 changes no ``activations`` byte (the estimate's fake forward and
  `measure` both see it).
* **Transients**: each dynamic cast of an ``n``-element tensor, in eager mode, takes
  ``abs`` (n x source bytes) for the amax, then ``x.to(float32) * scale`` (4n, and 4n
  more for the copy when the source is 16-bit), ``clamp`` (4n) and the e4m3/e5m2 copy
  (n): up to 9n bytes at once, leaving the n-byte FP8 copy and its fp32 scale (one per
  tensor, or one per row for ``rowwise``: the amax in float64 and the power-of-two
  rounding add a few bytes per scale). Forward casts the input and the weight; backward
  casts grad_output twice (once per GEMM layout) and the weight and the input again
  (``rowwise_with_gw_hp`` computes grad_weight from the 16-bit tensors instead). The
  FP8 copies live until the layer's forward or backward returns; before grad_input and
  grad_weight the operands are made row/column-major (FP8 copies of the weight, of
  grad_output's transpose and of the input).
* **The GEMM**: emulated (every CPU, ``emulate=True``) it dequantizes both operands to
  fp32 (``data.float() / scale``: 8 bytes per element at the peak), multiplies in fp32
  (4 bytes per output element) and casts the result to the input's dtype. On FP8 units
  (``torch._scaled_mm``, CUDA sm_89+) it writes the 16-bit result directly; rowwise
  scaling without fast accumulation (the two backward GEMMs) multiplies the result by
  an ``m x n`` fp32 outer product of the inverse scales afterwards.

`fp8_layer_transients` replays those allocations for one layer (M tokens, in K, out N)
and gives the forward and backward peaks of memory the layer allocates and frees again;
`fp8_transient_windows` measures the same quantity on a real step (`LiveBytes` windows
around each ``Float8Linear``'s forward and its backward node). Layers run one at a
time, so a step's ``fp8_cast_temporaries`` is the largest layer's peak, not a sum.
Under ``torch.compile`` the casts fuse and hold only the FP8 copies and their scales:
the eager figures here are an upper bound for compiled training.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal

import torch
from torch import nn

from mixprec.engine.fp8 import (
    fp8_layer_choice,
    is_float8_linear,
    refuse_float8_layers,
    refuse_other_float8_config,
)
from mixprec.islands import IslandRule
from mixprec.memory.transformer import TransformerShape
from mixprec.memory.transients import LiveBytes
from mixprec.policy import Float8Training, Policy

__all__ = [
    "FP8_RECIPE_CASTS",
    "Fp8Layer",
    "RecipeCasts",
    "fp8_layer_transients",
    "fp8_layers",
    "fp8_transient_windows",
    "layer_transients",
    "measured_transients",
    "refuse_converted",
    "resolve_emulate",
    "transformer_fp8_layers",
]

Granularity = Literal["tensorwise", "rowwise"] | None  # None: not cast (16-bit GEMM)


@dataclass(frozen=True)
class RecipeCasts:
    """How a torchao recipe casts each GEMM operand (None: kept in 16 bits).

    Attributes:
        input, weight, grad_output: the forward casts and backward grad_output's (for
            grad_input).
        weight_for_grad_input, grad_output_for_grad_weight, input_for_grad_weight:
            the other backward casts.
        pow2_scales: scales rounded down to a power of two (``log2``/``floor``/``exp2``).
        fast_accum: ``(output, grad_input, grad_weight)`` GEMMs with fast accumulation.
    """

    input: Granularity
    weight: Granularity
    grad_output: Granularity
    weight_for_grad_input: Granularity
    grad_output_for_grad_weight: Granularity
    input_for_grad_weight: Granularity
    pow2_scales: bool
    fast_accum: tuple[bool, bool, bool] = (True, False, False)


#: torchao 0.18's ``Float8LinearConfig.from_recipe_name`` as memory sees it (a test
#: holds this table against torchao's own configs).
FP8_RECIPE_CASTS: Mapping[str, RecipeCasts] = MappingProxyType(
    {
        "tensorwise": RecipeCasts(
            "tensorwise",
            "tensorwise",
            "tensorwise",
            "tensorwise",
            "tensorwise",
            "tensorwise",
            pow2_scales=False,
        ),
        "rowwise": RecipeCasts(
            "rowwise", "rowwise", "rowwise", "rowwise", "rowwise", "rowwise", pow2_scales=True
        ),
        "rowwise_with_gw_hp": RecipeCasts(
            "rowwise", "rowwise", "rowwise", "tensorwise", None, None, pow2_scales=True
        ),
    }
)


# ---------------------------------------------------------------- the replay


class _Replay:
    """Live bytes of a replayed allocation sequence, and their peak."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0

    def alloc(self, n: int) -> None:
        self.live += n
        self.peak = max(self.peak, self.live)

    def free(self, n: int) -> None:
        self.live -= n


def _cast(r: _Replay, numel: int, scales: int, src: int, pow2: bool) -> int:
    """torchao's eager dynamic cast (``hp_tensor_to_float8_dynamic``); returns the bytes
    it leaves held (the FP8 copy and its fp32 scales)."""
    r.alloc(numel * src)  # abs(x)
    r.alloc(scales * src)  # its amax (per tensor or per row)
    r.free(numel * src)
    r.alloc(8 * scales)  # amax in float64
    r.alloc(8 * scales)  # clamp(amax, EPS)
    r.alloc(8 * scales)  # reciprocal
    r.alloc(8 * scales)  # max / amax
    r.free(16 * scales)  # reciprocal, clamp
    r.alloc(4 * scales)  # the scale in fp32
    r.free(8 * scales)
    if pow2:
        r.alloc(4 * scales)  # log2
        r.alloc(4 * scales)  # floor
        r.free(4 * scales)
        r.alloc(4 * scales)  # exp2: the scale kept
        r.free(8 * scales)
    r.free(8 * scales + scales * src)  # the float64 amax, the amax
    if src != 4:
        r.alloc(4 * numel)  # x.to(float32)
    r.alloc(4 * numel)  # * scale
    if src != 4:
        r.free(4 * numel)
    r.alloc(4 * numel)  # clamp to the format's max
    r.alloc(numel)  # the e4m3/e5m2 copy
    r.free(8 * numel)
    return numel + 4 * scales


def _gemm(
    r: _Replay,
    m: int,
    k: int,
    n: int,
    *,
    copies: int,
    scales: tuple[int, int],
    repeat: int,
    emulate: bool,
    rowwise: bool,
    fast_accum: bool,
    out_bytes: int,
    out_transient: bool,
) -> None:
    """One FP8 GEMM (m x k by k x n) as ``float8_mm`` runs it, after the operands' casts."""
    r.alloc(copies + repeat)  # row/column-major FP8 copies; a tensorwise scale repeated
    out = out_bytes * m * n if out_transient else 0
    if emulate:
        r.alloc(8 * m * k)  # a.float(), / scale
        r.free(4 * m * k)
        r.alloc(8 * k * n)  # b.float(), / scale
        r.free(4 * k * n)
        fp32_out = 4 * m * n if (out_bytes != 4 or out_transient) else 0
        r.alloc(fp32_out)  # the fp32 product
        r.free(4 * m * k + 4 * k * n)
        if out_bytes != 4:
            r.alloc(out)  # .to(the input's dtype)
            r.free(fp32_out)
    else:
        r.alloc(4 * (scales[0] + scales[1]))  # inverse scales
        post = 4 * m * n if rowwise and not fast_accum else 0
        r.alloc(post)  # outer product of the inverse scales
        wide = rowwise and out_bytes != 2
        r.alloc(2 * m * n if wide else out)  # _scaled_mm writes bf16 for rowwise
        if wide:
            r.alloc(out)
            r.free(2 * m * n)
        r.free(post + 4 * (scales[0] + scales[1]))
    r.free(copies + repeat)


def _rows(g: Granularity, rows: int) -> int:
    return rows if g == "rowwise" else 1


def fp8_layer_transients(
    recipe: str,
    tokens: int,
    in_features: int,
    out_features: int,
    *,
    emulate: bool,
    input_bytes: int = 2,
    weight_bytes: int = 2,
    bias: bool = True,
) -> tuple[int, int]:
    """Peak bytes one ``Float8Linear`` allocates and frees again: (forward, backward).

    Replays torchao 0.18's eager casts and GEMMs (see the module docs) for a layer of
    `in_features` x `out_features` on `tokens` rows (batch x sequence). The output, the
    gradients and what is saved for backward are not transients and are not counted.

    Args:
        recipe: torchao's recipe name (`FP8_RECIPE_CASTS`).
        tokens: rows of the flattened input (M).
        in_features, out_features: K and N.
        emulate: the GEMM path: emulated (fp32 dequantized operands) or FP8 units.
        input_bytes: bytes per element of the input, grad_output and output (the
            autocast dtype: 2; 4 without autocast).
        weight_bytes: bytes per element of the stored weight.
        bias: the layer adds a bias (the GEMM's result is then a temporary).
    """
    try:
        c = FP8_RECIPE_CASTS[recipe]
    except KeyError:
        raise ValueError(
            f"unknown fp8 recipe {recipe!r}; valid recipes: {', '.join(FP8_RECIPE_CASTS)}"
        ) from None
    m, k, n = tokens, in_features, out_features
    for name, v in (("tokens", m), ("in_features", k), ("out_features", n)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    xb, wb, p2 = input_bytes, weight_bytes, c.pow2_scales
    fwd = _Replay()
    held = _cast(fwd, m * k, _rows(c.input, m), xb, p2)
    held += _cast(fwd, k * n, _rows(c.weight, n), wb, p2)
    _gemm(
        fwd, m, k, n,
        copies=0, scales=(_rows(c.input, m), _rows(c.weight, n)), repeat=0,
        emulate=emulate, rowwise=c.input == c.weight == "rowwise",
        fast_accum=c.fast_accum[0], out_bytes=xb, out_transient=bias,
    )  # fmt: skip

    bwd = _Replay()
    held = _cast(bwd, m * n, _rows(c.grad_output, m), xb, p2)
    held += _cast(bwd, k * n, _rows(c.weight_for_grad_input, k), wb, p2)
    mixed = (c.grad_output == "rowwise") != (c.weight_for_grad_input == "rowwise")
    _gemm(
        bwd, m, n, k,
        copies=k * n, scales=(_rows(c.grad_output, m), _rows(c.weight_for_grad_input, k)),
        repeat=4 * k if mixed else 0, emulate=emulate,
        rowwise=c.grad_output == c.weight_for_grad_input == "rowwise",
        fast_accum=c.fast_accum[1], out_bytes=xb, out_transient=False,
    )  # fmt: skip
    if c.grad_output_for_grad_weight is not None and c.input_for_grad_weight is not None:
        g, i = c.grad_output_for_grad_weight, c.input_for_grad_weight
        held += _cast(bwd, m * n, _rows(g, n), xb, p2)
        held += _cast(bwd, m * k, _rows(i, k), xb, p2)
        _gemm(
            bwd, n, m, k,
            copies=m * n + m * k, scales=(_rows(g, n), _rows(i, k)),
            repeat=0, emulate=emulate, rowwise=g == i == "rowwise",
            fast_accum=c.fast_accum[2], out_bytes=xb, out_transient=False,
        )  # fmt: skip
    bwd.free(held)
    return fwd.peak, bwd.peak


# ---------------------------------------------------------------- which path


def resolve_emulate(settings: Float8Training, device_type: str) -> tuple[bool, str]:
    """Whether the estimate replays emulated GEMMs or FP8 units, and why.

    The policy's ``emulate`` decides when set. Otherwise (auto), as `Precision.prepare`
    decides: FP8 units only on CUDA of capability 8.9+; a ``cuda`` estimate made where
    no GPU is visible assumes one with FP8 units (an H100), and says so.
    """
    if settings.emulate is not None:
        return settings.emulate, f"the policy sets emulate={settings.emulate}"
    if device_type != "cuda":
        return True, f"{device_type} has no FP8 GEMM units: torchao emulates them"
    if torch.cuda.is_available():
        from mixprec.engine.fp8 import fp8_hardware

        fast, why = fp8_hardware("cuda")
        return (not fast), why
    return False, "cuda assumed to have FP8 units (sm_89+; none visible here)"


# ---------------------------------------------------------------- which layers


@dataclass(frozen=True)
class Fp8Layer:
    """One converted layer as the estimate sees it: its name, shape and input.

    Attributes:
        name: qualified name in the model.
        tokens: rows of its flattened input (batch x sequence), None before a forward.
        in_features, out_features: its shape.
        bias: whether it adds a bias.
        input_bytes: bytes per element of its input after the autocast cast.
        weight_bytes: bytes per element of its stored weight.
    """

    name: str
    tokens: int | None
    in_features: int
    out_features: int
    bias: bool
    input_bytes: int
    weight_bytes: int


def _island_names(model: nn.Module, policy: Policy) -> tuple[str, ...]:
    from mixprec.islands import island_names

    return tuple(sorted(set(island_names(model)) | set(IslandRule.of(policy).module_names(model))))


def _bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def refuse_converted(model: nn.Module, policy: Policy, device_type: str) -> None:
    """Refuse what `Precision.prepare` refuses on a model an FP8 policy already converted:
    a policy without fp8 (its ``Float8Linear`` layers would keep training in FP8), or fp8
    settings whose torchao config differs from the layers' (the engine's own checks,
    `mixprec.engine.fp8.refuse_float8_layers` and ``refuse_other_float8_config``).

    Raises:
        PrecisionError: one line naming the layers and the fix.
    """
    settings = policy.fp8
    if settings is None:
        refuse_float8_layers(model, policy.name, fix="estimate")
        return
    emulate, _ = resolve_emulate(settings, device_type)
    refuse_other_float8_config(model, settings, emulate=emulate, policy=policy.name, fix="estimate")


@contextlib.contextmanager
def fp8_layers(model: nn.Module, policy: Policy) -> Iterator[list[Fp8Layer]]:
    """The layers of `model` that convert under `policy` (the engine's own choice,
    `mixprec.engine.fp8.fp8_layer_choice`), filled with their inputs by any forward
    run inside the context (the estimate's fake forward).

    Yields:
        One `Fp8Layer` per converted layer, in ``named_modules`` order; ``tokens`` is
        None for a layer the forward did not reach.
    """
    settings = policy.fp8
    if settings is None:
        yield []
        return
    convert, _ = fp8_layer_choice(model, settings, islands=_island_names(model, policy))
    weight_bytes = _bytes(policy.param_dtype)
    layers = [
        Fp8Layer(n, None, m.in_features, m.out_features, m.bias is not None, 2, weight_bytes)
        for n, m in convert
    ]

    def seen(index: int) -> Callable[[nn.Module, tuple[Any, ...]], None]:
        def hook(_module: nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0] if args else None
            if not isinstance(x, torch.Tensor):
                return
            dtype = x.dtype
            if x.is_floating_point() and torch.is_autocast_enabled(x.device.type):
                dtype = torch.get_autocast_dtype(x.device.type)  # what AutocastInput does
            old = layers[index]
            tokens = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
            layers[index] = Fp8Layer(
                old.name, max(tokens, old.tokens or 0), old.in_features, old.out_features,
                old.bias, _bytes(dtype), old.weight_bytes,
            )  # fmt: skip

        return hook

    handles = [m.register_forward_pre_hook(seen(i)) for i, (_, m) in enumerate(convert)]
    try:
        yield layers
    finally:
        for h in handles:
            h.remove()


def layer_transients(
    layers: list[Fp8Layer], recipe: str, *, emulate: bool
) -> tuple[int | None, int | None, str | None]:
    """(the largest forward transient, the largest backward transient, the layer with
    the larger of them) over `layers`; Nones when no layer saw a forward."""
    fwd: int | None = None
    bwd: int | None = None
    where: str | None = None
    best = -1
    for layer in layers:
        if not layer.tokens:
            continue
        f, b = fp8_layer_transients(
            recipe, layer.tokens, layer.in_features, layer.out_features, emulate=emulate,
            input_bytes=layer.input_bytes, weight_bytes=layer.weight_bytes, bias=layer.bias,
        )  # fmt: skip
        fwd, bwd = max(fwd or 0, f), max(bwd or 0, b)
        if max(f, b) > best:
            best, where = max(f, b), layer.name
    return fwd, bwd, where


def transformer_fp8_layers(shape: TransformerShape, policy: Policy) -> list[Fp8Layer]:
    """The distinct linear shapes of a `TransformerShape` that convert under `policy`.

    A block's MLP matrices (``hidden x ffn``, ``ffn x hidden``) and attention
    projections: separate query, key, value and output projections with a gated MLP
    (LLaMA: ``hidden x q_width``, ``hidden x kv_width`` under grouped-query attention,
    ``q_width x hidden``), a fused ``hidden x (q + 2 kv)`` one and the output
    projection otherwise (GPT), whose in and out features are divisible by
    ``min_divisor``. The output head and the first block's first projection are the
    last and first ``nn.Linear`` (kept by ``skip_first_last``); ``exclude`` patterns
    need module names and are not applied here. Biases as the shape says.
    """
    settings = policy.fp8
    if settings is None:
        return []
    h, f, q, kv = shape.hidden, shape.ffn, shape.q_width, shape.kv_width
    dims = {(h, f, shape.mlp_bias), (f, h, shape.mlp_bias), (q, h, shape.out_bias)}
    if shape.gated_mlp:
        dims |= {(h, q, shape.qkv_bias), (h, kv, shape.qkv_bias)}
    elif shape.n_layer > 1 or not settings.skip_first_last:
        dims.add((h, q + 2 * kv, shape.qkv_bias))
    d = settings.min_divisor
    tokens = shape.micro_batch * shape.seq_len
    x_bytes = _bytes(policy.effective_compute_dtype)
    return [
        Fp8Layer(f"{k}x{n}", tokens, k, n, bias, x_bytes, _bytes(policy.param_dtype))
        for k, n, bias in sorted(dims)
        if k % d == 0 and n % d == 0
    ]


# ---------------------------------------------------------------- measured


def _matmul_node(out: Any) -> Any:
    """The backward node of torchao's ``matmul_with_hp_or_float8_args`` behind `out`
    (the layer's output, or its bias add)."""
    node = getattr(out, "grad_fn", None)
    for _ in range(2):
        if node is None:
            return None
        if "matmul_with_hp_or_float8_args" in node.name():
            return node
        node = next((f for f, _ in node.next_functions if f is not None and
                     "matmul_with_hp_or_float8_args" in f.name()), None)  # fmt: skip
    return node


@contextlib.contextmanager
def fp8_transient_windows(model: nn.Module) -> Iterator[LiveBytes]:
    """Measure, on a real step run inside the context, what every ``Float8Linear`` of
    `model` allocates and frees again in its forward and in its backward.

    A window opens after the layer's forward pre-hooks (the autocast input cast is not
    the layer's) and closes when its forward returns; another opens and closes around
    the backward node of its FP8 matmul. Outside the windows the step runs without the
    recording mode.

    Yields:
        The `LiveBytes` recorder; its windows are labelled ``"<layer>/forward"`` and
        ``"<layer>/backward"``.
    """
    rec = LiveBytes()
    handles: list[Any] = []

    def opener(label: str) -> Callable[..., None]:
        def hook(*_args: Any) -> None:
            rec.open(label)

        return hook

    def closer(name: str) -> Callable[..., None]:
        def hook(_module: nn.Module, _args: Any, out: Any) -> None:
            rec.close()
            node = _matmul_node(out)
            if node is not None and torch.is_grad_enabled():
                node.register_prehook(opener(f"{name}/backward"))
                node.register_hook(lambda *_: rec.close())

        return hook

    for name, module in model.named_modules():
        if is_float8_linear(module):
            handles.append(module.register_forward_pre_hook(opener(f"{name}/forward")))
            handles.append(module.register_forward_hook(closer(name), always_call=True))
    try:
        yield rec
    finally:
        rec.close()
        for h in handles:
            h.remove()


def measured_transients(rec: LiveBytes) -> tuple[int | None, int | None, str | None]:
    """(the largest forward window, the largest backward window, the layer of the
    larger) of a `fp8_transient_windows` recording; Nones when no window ran."""
    peaks: dict[str, dict[str, int]] = {"forward": {}, "backward": {}}
    for w in rec.windows:
        name, _, phase = w.label.rpartition("/")
        peaks[phase][name] = max(peaks[phase].get(name, 0), w.transient_peak())
    fwd = max(peaks["forward"].values(), default=None)
    bwd = max(peaks["backward"].values(), default=None)
    both = {**peaks["forward"]}
    for k, v in peaks["backward"].items():
        both[k] = max(both.get(k, 0), v)
    where = max(both, key=lambda k: both[k]) if both else None
    return fwd, bwd, where
