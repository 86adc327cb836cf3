"""Published model configs (the fields of their ``config.json``), written out: no download.

Used to hold `TransformerShape.from_config` against the model transformers builds.
"""

from __future__ import annotations

from typing import Any

#: meta-llama/Llama-3.2-1B: grouped-query attention (8 of 32 heads), tied embeddings.
LLAMA_3_2_1B: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "attention_bias": False,
    "mlp_bias": False,
}

#: meta-llama/Meta-Llama-3-8B: grouped-query attention, an untied head.
LLAMA_3_8B: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "attention_bias": False,
    "mlp_bias": False,
}

#: Qwen/Qwen2-0.5B: biases on q, k and v only, 2 key/value heads, tied embeddings.
QWEN2_0_5B: dict[str, Any] = {
    "model_type": "qwen2",
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
}

#: mistralai/Mistral-7B-v0.1: grouped-query attention, sliding window.
MISTRAL_7B: dict[str, Any] = {
    "model_type": "mistral",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
}

#: openai-community/gpt2: biases everywhere, LayerNorm, learned positions, tied head.
GPT2: dict[str, Any] = {
    "model_type": "gpt2",
    "n_layer": 12,
    "n_embd": 768,
    "n_head": 12,
    "vocab_size": 50257,
    "n_positions": 1024,
    "n_ctx": 1024,
    "activation_function": "gelu_new",
    "layer_norm_epsilon": 1e-5,
}

#: Qwen/Qwen3-0.6B: grouped-query attention, per-head q_norm and k_norm, tied embeddings.
QWEN3_0_6B: dict[str, Any] = {
    "model_type": "qwen3",
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "attention_bias": False,
}

#: microsoft/Phi-3-mini-4k-instruct, without hidden_act (transformers' default: silu).
PHI3_MINI: dict[str, Any] = {
    "model_type": "phi3",
    "hidden_size": 3072,
    "intermediate_size": 8192,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "vocab_size": 32064,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}

CONFIGS: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": LLAMA_3_2_1B,
    "llama-3-8b": LLAMA_3_8B,
    "qwen2-0.5b": QWEN2_0_5B,
    "mistral-7b": MISTRAL_7B,
    "gpt2": GPT2,
    "qwen3-0.6b": QWEN3_0_6B,
    "phi3-mini": PHI3_MINI,
}
