"""Signal-to-noise ratio of an emulated FP8 linear against fp32, per torchao recipe.

One linear layer ``y = x @ W.T`` (x: M x K, W: N x K, no bias) converted the way
`Precision.prepare` converts one (torchao's ``Float8Linear`` with the recipe's
``Float8LinearConfig`` and ``emulate=True``), run forward and backward with a fixed
grad_output. Each of its three GEMMs is compared with the same GEMM on the same
fp32 tensors computed in float64:

* output       ``y = x @ W.T``
* grad_input   ``dx = dy @ W``
* grad_weight  ``dW = dy.T @ x``

SNR (dB) = ``10 * log10(||ref||^2 / ||ref - out||^2)``, over the whole result, and
for the output also over the plain rows only (the rows of x that are not outlier
tokens: a whole-tensor SNR is dominated by the outliers' own energy). Rows:

* ``fp8 <recipe>``: the FP8 layer on fp32 tensors: the FP8 casts' error alone
  (emulation dequantizes and multiplies in fp32);
* ``fp8 <recipe> (bf16)``: the same layer on bf16 weights and inputs under bf16
  autocast, as the ``fp8_*`` presets run it (bf16 rounding of the operands and
  results included);
* ``bf16``: a plain linear under bf16 autocast on bf16 tensors, for scale.

Inputs (``--m/--k/--n``, default 2048 x 1024 @ 1024 x 1024), standard normal x and
grad_output, W at 1/sqrt(K): ``normal``; ``outlier tokens``: 1% of the rows of x
and of grad_output scaled by 10^4 (the plain rows then sit 13 octaves below the
tensor's amax: near e4m3's subnormals under one scale per tensor); ``outlier
channels``: 8 input features of x scaled by 50 (the outliers of LLM activations).

    OMP_NUM_THREADS=2 python bench/fp8_snr.py [--m 2048 --k 1024 --n 1024] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import platform

import torch
from torch import nn

from mixprec import device_caps
from mixprec.engine.fp8 import AutocastInput, float8_linear_config, load_torchao_float8
from mixprec.policy import FP8_RECIPES, Float8Training

GEMMS = ("output", "grad_input", "grad_weight")
OUTLIER_TOKEN_SCALE = 1e4


def snr_db(ref: torch.Tensor, out: torch.Tensor) -> float:
    """``10 * log10(||ref||^2 / ||ref - out||^2)`` in float64 (inf when equal)."""
    ref, out = ref.double(), out.double()
    noise = (ref - out).square().sum().item()
    if noise == 0.0:
        return math.inf
    return 10.0 * math.log10(ref.square().sum().item() / noise)


def make_case(
    case: str, m: int, k: int, n: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (m x k), W (n x k) and grad_output (m x n) in fp32 for one input case, and
    the mask of the plain rows (not outlier tokens)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) / math.sqrt(k)
    dy = torch.randn(m, n, generator=g)
    plain = torch.ones(m, dtype=torch.bool)
    if case == "outlier tokens":
        rows = torch.randperm(m, generator=g)[: max(1, m // 100)]
        x[rows] *= OUTLIER_TOKEN_SCALE
        dy[rows] *= OUTLIER_TOKEN_SCALE
        plain[rows] = False
    elif case == "outlier channels":
        cols = torch.randperm(k, generator=g)[:8]
        x[:, cols] *= 50.0
    elif case != "normal":
        raise ValueError(f"unknown case {case!r}")
    return x, w, dy, plain


def reference(
    x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The three GEMMs in float64 on the fp32 tensors."""
    x64, w64, dy64 = x.double(), w.double(), dy.double()
    return x64 @ w64.T, dy64 @ w64, dy64.T @ x64


def run_layer(
    layer: nn.Module, x: torch.Tensor, dy: torch.Tensor, dtype: torch.dtype, autocast: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward and backward of `layer` (weights already in `dtype`); its three results."""
    xin = x.detach().to(dtype).clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = layer(xin)
    y.backward(dy.to(y.dtype))
    assert xin.grad is not None and layer.weight.grad is not None
    return y.detach(), xin.grad, layer.weight.grad


def fp8_layer(recipe: str, w: torch.Tensor, dtype: torch.dtype) -> nn.Module:
    """torchao's Float8Linear for `recipe` (emulated), holding W in `dtype`."""
    load_torchao_float8("bench/fp8_snr.py")
    from torchao.float8.float8_linear import Float8Linear

    linear = nn.Linear(w.shape[1], w.shape[0], bias=False)
    with torch.no_grad():
        linear.weight.copy_(w.to(dtype))
    linear = linear.to(dtype)
    config = float8_linear_config(Float8Training(recipe=recipe), emulate=True)
    layer = Float8Linear.from_float(linear, config=config)
    layer.register_forward_pre_hook(AutocastInput())  # as Precision.prepare does
    return layer


def plain_layer(w: torch.Tensor, dtype: torch.dtype) -> nn.Module:
    linear = nn.Linear(w.shape[1], w.shape[0], bias=False)
    with torch.no_grad():
        linear.weight.copy_(w)
    return linear.to(dtype)


def measure(m: int, k: int, n: int, seed: int) -> list[dict[str, object]]:
    """One row per case and layer: the SNR of each GEMM."""
    rows: list[dict[str, object]] = []
    for case in ("normal", "outlier tokens", "outlier channels"):
        x, w, dy, plain = make_case(case, m, k, n, seed)
        ref = reference(x, w, dy)
        # (row name, torchao recipe or None for a plain linear, storage dtype, autocast)
        layers: list[tuple[str, str | None, torch.dtype, bool]] = []
        for recipe in FP8_RECIPES:
            layers.append((f"fp8 {recipe}", recipe, torch.float32, False))
            layers.append((f"fp8 {recipe} (bf16)", recipe, torch.bfloat16, True))
        layers.append(("bf16", None, torch.bfloat16, True))
        for name, recipe, dtype, autocast in layers:
            layer = plain_layer(w, dtype) if recipe is None else fp8_layer(recipe, w, dtype)
            got = run_layer(layer, x, dy, dtype, autocast)
            rows.append(
                {
                    "case": case,
                    "layer": name,
                    **{g: round(snr_db(r, o), 2) for g, r, o in zip(GEMMS, ref, got, strict=True)},
                    "output_plain_rows": round(snr_db(ref[0][plain], got[0][plain]), 2),
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, default=2048, help="rows of x (tokens)")
    parser.add_argument("--k", type=int, default=1024, help="input features")
    parser.add_argument("--n", type=int, default=1024, help="output features")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args()
    float8 = load_torchao_float8("bench/fp8_snr.py")
    rows = measure(args.m, args.k, args.n, args.seed)
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    import torchao

    print(
        f"x {args.m}x{args.k} @ W.T {args.k}x{args.n}, seed {args.seed}; "
        f"{device_caps('cpu').name} ({platform.machine()}), {torch.get_num_threads()} threads; "
        f"torch {torch.__version__}, torchao {torchao.__version__} "
        f"({float8.__name__}, emulate=True); SNR in dB against float64 on the fp32 tensors"
    )
    head = (
        f"{'case':<17} {'layer':<30} {'output':>7} {'grad_input':>11} {'grad_weight':>12} "
        f"{'output (plain rows)':>20}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['case']:<17} {r['layer']:<30} {r['output']:>7.2f} "
            f"{r['grad_input']:>11.2f} {r['grad_weight']:>12.2f} {r['output_plain_rows']:>20.2f}"
        )


if __name__ == "__main__":
    main()
