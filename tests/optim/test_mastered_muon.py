"""Muon as users run it (issue 34, item 4): the 2-D hidden weights of a small GPT under
``Mastered(torch.optim.Muon)``, everything else (embeddings, tied head, norms, biases)
under `mixprec.optim.AdamW`, both with exact masters over bf16 storage, stepped in one
`Precision` step with clipping. Fed the same gradients, the masters equal bit for bit
the same recipe on fp32 parameters: ``torch.optim.Muon`` for the hidden weights and
`mixprec.optim.AdamW` for the rest (fp32 parameters are their own master).
"""

from __future__ import annotations

import torch
from torch import nn

import mixprec
from mixprec.optim import AdamW, Mastered
from mixprec.workloads.gpt import GPT, GPTConfig

STEPS = 6
VOCAB = 48
MUON = {"lr": 0.02, "weight_decay": 0.01}
ADAMW = {"lr": 3e-3, "weight_decay": 0.1}


def _is_hidden(name: str, p: torch.Tensor) -> bool:
    return name.startswith("blocks.") and p.ndim == 2


def test_muon_hidden_weights_and_adamw_rest_equal_the_fp32_recipe_bitwise() -> None:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=VOCAB, block_size=16, n_layer=2, n_head=2, n_embd=32)
    prec = mixprec.Precision("bf16_master")
    model = prec.prepare(GPT(config))
    named = list(model.named_parameters())
    hidden = [p for n, p in named if _is_hidden(n, p)]
    rest = [p for n, p in named if not _is_hidden(n, p)]
    muon = prec.optimizer(hidden, optimizer=torch.optim.Muon, **MUON)
    adamw = prec.optimizer(rest, **ADAMW)
    assert isinstance(muon, Mastered) and isinstance(adamw, AdamW)
    assert {muon.format_of(p)[0] for p in hidden} == {"exact"}
    assert {adamw.format_of(p)[0] for p in rest} == {"exact", "none"}  # norms: fp32 islands

    ref_hidden = [nn.Parameter(p.detach().float()) for p in hidden]
    ref_rest = [nn.Parameter(p.detach().float()) for p in rest]
    ref_muon = torch.optim.Muon(ref_hidden, **MUON)
    ref_adamw = AdamW(ref_rest, **ADAMW)
    gen = torch.Generator().manual_seed(0)
    for step in range(STEPS):
        tokens = torch.randint(0, VOCAB, (4, 17), generator=gen)
        with prec.autocast():
            logits = model(tokens[:, :-1]).float()
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        prec.backward(loss)
        prec.clip_grad_norm_(model.parameters(), 0.5)
        for ours, ref in zip(hidden + rest, ref_hidden + ref_rest, strict=True):
            assert ours.grad is not None
            ref.grad = ours.grad.float()
        assert prec.step([muon, adamw]).applied, step
        ref_muon.step()
        ref_adamw.step()
        for opt in (muon, adamw):
            opt.zero_grad(set_to_none=True)
        for masters, refs in (
            (muon.master_weights(), ref_hidden),
            (adamw.master_weights(), ref_rest),
        ):
            for i, (m, r) in enumerate(zip(masters, refs, strict=True)):
                assert torch.equal(m.view(torch.int32), r.detach().view(torch.int32)), (step, i)
