"""A tiny Llama trained in an Accelerate loop under a mixprec policy (CPU, no downloads).

    pip install torch==2.13.0 && pip install "mixprec[accelerate]" transformers
    OMP_NUM_THREADS=2 python examples/accelerate_loop.py [policy]

Five lines differ from a plain Accelerate loop: prepare and the optimizer come from
the `Precision`, autocast is the policy's, and `AcceleratedPrecision` does the
backward and the step (clip, skip a non-finite update, hold the schedule on it).
See docs/integrations/accelerate.md.
"""

from __future__ import annotations

import sys

import torch
import transformers
from accelerate import Accelerator

import mixprec
from mixprec.integrations.accelerate import AcceleratedPrecision


def main(policy: str = "bf16_master", steps: int = 32) -> list[float]:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
    )
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    prec = mixprec.Precision(policy)
    model = prec.prepare(transformers.LlamaForCausalLM(config))
    opt = prec.optimizer(model, lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    text = torch.tensor(list(b"The quick brown fox jumps over the lazy dog. " * 200))
    rows = text[: steps * 2 * 4 * 16].view(-1, 16)
    loader = torch.utils.data.DataLoader(rows, batch_size=4)
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    loop = AcceleratedPrecision(accelerator, prec)
    losses = []
    for batch in loader:
        with accelerator.accumulate(model):
            with prec.autocast():
                loss = model(input_ids=batch, labels=batch).loss
            loop.backward(loss)
            loop.step(opt, sched, max_norm=1.0)
        losses.append(float(loss.detach()))
    print(prec.summary())
    print(f"steps {prec.stats.steps}, skipped {prec.stats.skipped_steps}, loss {losses[-1]:.3f}")
    return losses


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bf16_master")
