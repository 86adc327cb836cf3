"""Moment storage formats for AdamW's first and second moments."""

from mixprec.optim.moments.base import MomentFormat
from mixprec.optim.moments.dense import DenseMoments
from mixprec.optim.moments.int8 import (
    Int8Moments,
    dequantize_signed,
    dequantize_sqrt,
    quantize_signed,
    quantize_sqrt,
)

__all__ = [
    "DenseMoments",
    "Int8Moments",
    "MomentFormat",
    "dequantize_signed",
    "dequantize_sqrt",
    "quantize_signed",
    "quantize_sqrt",
]
