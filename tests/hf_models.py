"""Small Hugging Face models built from configs (never downloaded), for tests."""

from __future__ import annotations

from typing import Any

import pytest
from torch import nn


def tiny_llama(**overrides: Any) -> nn.Module:
    """A ``LlamaForCausalLM`` with grouped-query attention (4 heads, 2 key/value heads),
    2 layers of width 64 and 256 tokens; `overrides` are ``LlamaConfig`` fields.
    Skips the test when transformers is not installed."""
    transformers = pytest.importorskip("transformers")
    fields: dict[str, Any] = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 256,
        "max_position_embeddings": 64,
    }
    model: nn.Module = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**{**fields, **overrides})
    )
    return model
