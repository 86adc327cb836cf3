"""A tiny Llama trained by a Lightning Trainer under a mixprec policy (CPU, no downloads).

    pip install torch==2.13.0 && pip install "lightning>=2.6,<2.7" transformers
    OMP_NUM_THREADS=2 python examples/lightning_trainer.py [policy]

The plugin makes the Trainer run the README loop: prepare, autocast, scaled
backward, clipping of true gradients, a step that skips non-finite updates
(and holds the LR schedule on them). See docs/integrations/lightning.md.
"""

from __future__ import annotations

import sys

import lightning as L
import torch
import transformers

import mixprec
from mixprec.integrations.lightning import MixprecPrecision


class TinyLlama(L.LightningModule):
    def __init__(self, prec: mixprec.Precision) -> None:
        super().__init__()
        self.prec = prec
        config = transformers.LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=256,
        )
        self.net = transformers.LlamaForCausalLM(config)

    def training_step(self, batch: torch.Tensor, _index: int) -> torch.Tensor:
        loss: torch.Tensor = self.net(input_ids=batch, labels=batch).loss
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> object:
        opt = self.prec.optimizer(self, lr=3e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main() -> None:
    torch.manual_seed(0)
    prec = mixprec.Precision(sys.argv[1] if len(sys.argv) > 1 else "bf16_master")
    text = torch.tensor(list(b"The quick brown fox jumps over the lazy dog. " * 200))
    batches = text[: 64 * 16 * 4].view(64, 4, 16)
    loader = torch.utils.data.DataLoader(list(batches), batch_size=None)
    plugin = MixprecPrecision(prec)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=64,
        plugins=[plugin],
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,  # this example saves nothing (see the docs for resuming)
    )
    trainer.fit(TinyLlama(prec), loader)
    print(prec.summary())
    print(f"steps {prec.stats.steps}, skipped {prec.stats.skipped_steps}")


if __name__ == "__main__":
    main()
