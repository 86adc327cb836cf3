"""Moment storage formats for AdamW's first and second moments.

One module per format family holds its `MomentSpec` (plain data), its encode
and decode, and its registration (so the import order below is the registry's
order); as with the masters, torch is imported inside the functions that use
tensors, so the specs load without it.
"""

# isort: skip_file

from mixprec.formats.moments.base import MomentFormat
from mixprec.formats.moments.dense import DenseMoments
from mixprec.formats.moments.int8 import (
    Int8Moments,
    dequantize_signed,
    dequantize_sqrt,
    quantize_signed,
    quantize_sqrt,
)
from mixprec.formats.moments.int4 import Int4Moments

__all__ = [
    "DenseMoments",
    "Int4Moments",
    "Int8Moments",
    "MomentFormat",
    "dequantize_signed",
    "dequantize_sqrt",
    "quantize_signed",
    "quantize_sqrt",
]
