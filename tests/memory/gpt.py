"""The built-in workload GPT and one batch, shared by the memory tests."""

from __future__ import annotations

import torch
from torch import nn

from mixprec.memory import TransformerShape
from mixprec.workloads import load_workload

GiB = 2**30


def gpt_and_batch(size: str = "tiny") -> tuple[object, nn.Module, torch.Tensor, torch.Tensor]:
    wl = load_workload("shakespeare", size=size)
    model = wl.make_model(0)
    x, y = wl.train_batch(step=0, seed=0, batch_size=wl.defaults.batch_size, device="cpu")
    return wl, model, x, y


def shape_of(model: nn.Module, x: torch.Tensor) -> TransformerShape:
    """The workload GPT described as a config (what `mixprec budget --config` reads)."""
    cfg = model.config  # type: ignore[attr-defined]
    return TransformerShape(
        n_layer=cfg.n_layer,
        hidden=cfg.n_embd,
        n_head=cfg.n_head,
        vocab=cfg.vocab_size,
        seq_len=cfg.block_size,
        micro_batch=x.shape[0],
        tied_embeddings=cfg.tie_weights,
        learned_positions=True,
    )
