"""Moment storage formats for AdamW's first and second moments.

One module per format family; each declares its `MomentSpec` and registers itself
when imported, so the import order below is the registry's (table) order.
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

__all__ = [
    "DenseMoments",
    "Int8Moments",
    "MomentFormat",
    "dequantize_signed",
    "dequantize_sqrt",
    "quantize_signed",
    "quantize_sqrt",
]
