"""mixprec inside the Hugging Face `Trainer`: one argument, `precision=`.

A tiny Llama built from a config (nothing is downloaded) trains on the bytes of a
sentence. The trainer's own settings do the rest: `max_grad_norm` clips the true
(unscaled) gradients, `save_steps` checkpoints hold the loss scale, and every
logged step says how many steps were skipped and at which loss scale.

    python examples/hf_trainer.py                 # bf16 weights with an exact fp32 master
    python examples/hf_trainer.py amp_fp16        # fp16 autocast with dynamic loss scaling
    python examples/hf_trainer.py bf16_master --lora   # PEFT LoRA adapters (needs peft)

See docs/integrations/hf.md.
"""

from __future__ import annotations

import sys
import tempfile

import torch
import transformers

from mixprec.integrations.hf import PrecisionTrainer


def main(policy: str = "bf16_master", *, lora: bool = False, steps: int = 20) -> list[float]:
    """Train `steps` steps under `policy`; returns the logged losses."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=64,
    )
    model = transformers.LlamaForCausalLM(config)
    if lora:
        import peft

        model = peft.get_peft_model(
            model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
        )
    text = b"To be, or not to be, that is the question. " * 200
    rows = torch.tensor(list(text[: steps * 4 * 32])).view(steps * 4, 32)
    dataset = [{"input_ids": row, "labels": row} for row in rows]
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out,
            max_steps=steps,
            per_device_train_batch_size=4,
            learning_rate=1e-3,
            max_grad_norm=1.0,  # clips the true gradients, after the unscale
            logging_steps=5,
            save_steps=10,  # each checkpoint also holds precision.pt (loss scale, skips)
            report_to=[],  # or "tensorboard", "wandb", ...: the precision keys go there too
            use_cpu=not torch.cuda.is_available(),
            # leave fp16 and bf16 False: the policy sets the precision
        )
        trainer = PrecisionTrainer(model=model, args=args, train_dataset=dataset, precision=policy)
        trainer.train()
        print(trainer.precision.summary())
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


if __name__ == "__main__":
    positional = [a for a in sys.argv[1:] if not a.startswith("--")]
    main(positional[0] if positional else "bf16_master", lora="--lora" in sys.argv)
