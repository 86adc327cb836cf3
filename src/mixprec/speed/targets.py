"""What is timed: a user's model on an example input, or a list of matmul shapes.

A step is one forward and backward under ``torch.autocast`` in the format
(none for fp32), with gradients on, as a training loop runs it. The user's model
is never changed: the step calls it through `torch.func.functional_call` with
detached aliases of its parameters (no copy of the weights; gradients land on
the aliases, never on ``param.grad``) and clones of its buffers (a BatchNorm's
running statistics stay as they were). Input tensors are detached too. The
caller restores the RNG state (`mixprec.speed.measure` does, with
`torch.random.fork_rng`), since dropout draws from it.

The fp16 step multiplies the loss by a constant loss scale and unscales the
gradients after the backward, as ``amp_fp16``'s dynamic loss scaling does.

A matmul shape ``MxNxK`` is a linear layer's training step: an ``(M, K)``
input that needs its gradient (as any layer but the first) times a ``(K, N)``
weight, so the step runs three matmuls: the forward, the input gradient and the
weight gradient.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call

from mixprec.dtypes import parse_dtype
from mixprec.speed.timing import Step

__all__ = [
    "MAX_DIM",
    "MAX_ELEMENTS",
    "LossFn",
    "MatmulShape",
    "default_loss",
    "describe_model",
    "format_shapes",
    "matmul_model",
    "model_signature",
    "model_steps",
    "parse_shapes",
]

#: ``loss_fn(output) -> scalar tensor``: reduces a model's output to the loss to backward.
LossFn = Callable[[Any], Tensor]

#: The loss scale of the timed fp16 step (the initial scale of `LossScaling`).
_FP16_LOSS_SCALE = 2.0**16

#: The largest matmul dimension `parse_shapes` accepts (one dimension).
MAX_DIM = 1 << 20
#: The largest number of elements in one matmul's three operands (4 GiB in fp32).
MAX_ELEMENTS = 1 << 30


@dataclass(frozen=True)
class MatmulShape:
    """A linear layer's matmul: an ``(m, k)`` input times a ``(k, n)`` weight.

    Attributes:
        m: rows of the input (tokens in a batch).
        n: output features.
        k: input features (the reduction dimension).
    """

    m: int
    n: int
    k: int

    def __post_init__(self) -> None:
        for name in ("m", "n", "k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_DIM:
                raise ValueError(
                    f"matmul dimension {name} must be an int in 1..{MAX_DIM}, got {value!r}"
                )
        elements = self.m * self.k + self.k * self.n + self.m * self.n
        if elements > MAX_ELEMENTS:
            raise ValueError(
                f"matmul {self} has {elements:,} elements in its operands; at most "
                f"{MAX_ELEMENTS:,} are probed"
            )

    def __str__(self) -> str:
        return f"{self.m}x{self.n}x{self.k}"


_SHAPE = re.compile(r"\s*(\d+)\s*[xX]\s*(\d+)\s*[xX]\s*(\d+)\s*")


def parse_shapes(text: str | Sequence[str]) -> tuple[MatmulShape, ...]:
    """Matmul shapes from ``"MxNxK"`` strings, each possibly a comma-separated list.

    Example: ``parse_shapes("4096x4096x4096,4096x11008x4096")``.

    Raises:
        ValueError: an empty list, or an item that is not three positive ints joined
            by ``x`` (or too large), naming it.
    """
    items = [text] if isinstance(text, str) else list(text)
    shapes: list[MatmulShape] = []
    for item in items:
        if not isinstance(item, str):
            raise TypeError(f"a matmul shape must be a string 'MxNxK', got {item!r}")
        for part in item.split(","):
            match = _SHAPE.fullmatch(part)
            if match is None:
                raise ValueError(
                    f"bad matmul shape {part.strip()!r}: give MxNxK (M rows, N output and K input "
                    "features), e.g. 4096x4096x4096, or a comma-separated list"
                )
            m, n, k = (int(g) for g in match.groups())
            try:
                shapes.append(MatmulShape(m, n, k))
            except ValueError as exc:
                raise ValueError(f"bad matmul shape {part.strip()!r}: {exc}") from None
    if not shapes:
        raise ValueError("no matmul shapes given: e.g. 4096x4096x4096")
    return tuple(shapes)


def format_shapes(shapes: Sequence[MatmulShape]) -> str:
    """The shapes as ``parse_shapes`` reads them back."""
    return ",".join(str(s) for s in shapes)


class _Matmuls(nn.Module):
    """One bias-free linear layer per shape; forward takes one input per shape."""

    def __init__(self, shapes: Sequence[MatmulShape]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(s.k, s.n, bias=False) for s in shapes)

    def forward(self, *inputs: Tensor) -> list[Tensor]:
        return [layer(x) for layer, x in zip(self.layers, inputs, strict=True)]


def matmul_model(
    shapes: Sequence[MatmulShape], *, device: torch.device | str = "cpu"
) -> tuple[nn.Module, tuple[Tensor, ...]]:
    """A model and example input whose training step runs exactly the given matmuls.

    Weights are fp32 (as under every `auto` candidate) from a fixed seed; inputs are
    fp32 and require their gradients. The global RNG is left as it was.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = _Matmuls(shapes)
        inputs = tuple(torch.randn(s.m, s.k, requires_grad=True) for s in shapes)
    model.to(device)
    return model, tuple(x.detach().to(device).requires_grad_() for x in inputs)


def _first_float_tensor(output: Any) -> Tensor | None:
    if isinstance(output, Tensor):
        return output if output.is_floating_point() else None
    if isinstance(output, Mapping):
        values: Any = output.values()
    elif isinstance(output, (list, tuple)):
        values = output
    else:
        values = [getattr(output, name, None) for name in ("loss", "logits")]
    for value in values:
        found = _first_float_tensor(value)
        if found is not None:
            return found
    return None


def default_loss(output: Any) -> Tensor:
    """The mean of the model's output, upcast to fp32.

    A list or tuple of tensors (the shape probe's) sums each one's mean; otherwise
    the first floating tensor found (in a tuple, list or dict, or an object's
    ``loss`` or ``logits``) is used.

    Raises:
        TypeError: the output holds no floating tensor.
    """
    if isinstance(output, (list, tuple)) and output and all(isinstance(o, Tensor) for o in output):
        floats = [o for o in output if o.is_floating_point()]
        if floats:
            return torch.stack([o.float().mean() for o in floats]).sum()
    found = _first_float_tensor(output)
    if found is None:
        raise TypeError(
            f"cannot find a floating tensor in the model's output ({type(output).__name__}) "
            "to backward from: pass loss_fn"
        )
    return found.float().mean()


def _detach_inputs(value: Any) -> Any:
    if isinstance(value, Tensor):
        alias = value.detach()
        return alias.requires_grad_() if value.requires_grad else alias
    if isinstance(value, tuple):
        return tuple(_detach_inputs(v) for v in value)
    if isinstance(value, list):
        return [_detach_inputs(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _detach_inputs(v) for k, v in value.items()}
    return value


def _leaf_tensors(value: Any) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value] if value.requires_grad else []
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _leaf_tensors(v)]
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in _leaf_tensors(v)]
    return []


def _call_args(example_input: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A tuple is the positional arguments, a mapping the keyword arguments, anything
    else the one argument."""
    if isinstance(example_input, tuple):
        return example_input, {}
    if isinstance(example_input, Mapping):
        return (), dict(example_input)
    return (example_input,), {}


@contextmanager
def model_steps(
    model: nn.Module,
    example_input: Any,
    *,
    formats: Sequence[str],
    device_type: str,
    loss_fn: LossFn | None = None,
) -> Iterator[dict[str, Step]]:
    """The training step of each format on `model`, which stays untouched.

    Args:
        model: the model, on the device its step runs on.
        example_input: its input: a tuple is the positional arguments, a mapping
            the keyword arguments, anything else the one argument.
        formats: compute format names (``"fp32"``, ``"bf16"``, ``"fp16"``).
        device_type: the autocast device type (``"cpu"``, ``"cuda"``...).
        loss_fn: reduces the output to the loss (default `default_loss`).
    """
    loss = default_loss if loss_fn is None else loss_fn
    params = {
        name: p.detach().requires_grad_(p.requires_grad) for name, p in model.named_parameters()
    }
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    state = {**params, **buffers}
    args, kwargs = _call_args(_detach_inputs(example_input))
    leaves = [p for p in params.values() if p.requires_grad] + _leaf_tensors((args, kwargs))

    def make_step(name: str) -> Step:
        dtype = None if name == "fp32" else parse_dtype(name)
        scale = _FP16_LOSS_SCALE if dtype == torch.float16 else None

        def step() -> None:
            for leaf in leaves:
                leaf.grad = None
            with (
                torch.enable_grad(),
                torch.autocast(
                    device_type, dtype=dtype or torch.float32, enabled=dtype is not None
                ),
            ):
                out = functional_call(model, state, args, kwargs)
                value = loss(out)
            if not value.requires_grad:
                raise ValueError(
                    "the loss does not depend on any trainable parameter (none, all frozen, "
                    "or the output detached): a training step cannot be timed; give a model "
                    "with trainable parameters, or time matmul shapes instead"
                )
            if scale is None:
                torch.autograd.backward(value)
                return
            torch.autograd.backward(value * scale)
            grads = [leaf.grad for leaf in leaves if leaf.grad is not None]
            if grads:
                torch._foreach_mul_(grads, 1.0 / scale)

        return step

    try:
        yield {name: make_step(name) for name in formats}
    finally:
        for leaf in leaves:
            leaf.grad = None


def _describe_value(value: Any) -> str:
    if isinstance(value, Tensor):
        return f"T{tuple(value.shape)}:{value.dtype}:{value.device.type}:{value.requires_grad}"
    if isinstance(value, (list, tuple)):
        inner = ",".join(_describe_value(v) for v in value)
        return f"{type(value).__name__}[{inner}]"
    if isinstance(value, Mapping):
        inner = ",".join(f"{k!s}={_describe_value(v)}" for k, v in sorted(value.items(), key=str))
        return f"map[{inner}]"
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    return type(value).__qualname__


def model_signature(model: nn.Module, example_input: Any, loss_fn: LossFn | None = None) -> str:
    """A digest of what decides the step's cost: module types and modes, parameter and
    buffer shapes and dtypes, the input's structure, shapes and dtypes, the loss."""
    parts = [
        f"{name}:{type(m).__module__}.{type(m).__qualname__}:{m.training}"
        for name, m in model.named_modules()
    ]
    parts += [
        f"p:{name}:{tuple(p.shape)}:{p.dtype}:{p.requires_grad}"
        for name, p in model.named_parameters()
    ]
    parts += [f"b:{name}:{tuple(b.shape)}:{b.dtype}" for name, b in model.named_buffers()]
    parts.append(f"in:{_describe_value(example_input)}")
    loss_name = "default" if loss_fn is None else getattr(loss_fn, "__qualname__", repr(loss_fn))
    parts.append(f"loss:{loss_name}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def describe_model(model: nn.Module, example_input: Any) -> str:
    """``GPT (0.11M params), input (32, 64) int64``: a short description for reasons."""
    numel = sum(p.numel() for p in model.parameters())
    size = f"{numel / 1e6:.2f}M" if numel >= 10_000 else f"{numel:,}"
    shapes = [
        f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"
        for t in _all_tensors(example_input)
    ]
    text = f"{type(model).__name__} ({size} params)"
    return (
        f"{text}, input {', '.join(shapes[:3])}{', ...' if len(shapes) > 3 else ''}"
        if shapes
        else text
    )


def _all_tensors(value: Any) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _all_tensors(v)]
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in _all_tensors(v)]
    return []
