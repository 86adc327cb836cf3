"""mixprec inside TRL's `SFTTrainer` (`PrecisionTrainerMixin` first): bitwise against the
README loop that computes SFTTrainer's loss.

The model, data, schedule and comparison are test_hf.py's. SFTTrainer (TRL 1.16) does
not compute the model's own loss: it installs TRL's fused LM head on the model
(`trl.trainer.utils.add_fused_lm_head`, log-probabilities computed in vocabulary tiles
with fp32 accumulation, its own backward) and takes `-sum(log_probs) /
num_items_in_batch`, the count of labelled next tokens (Trainer's
`_get_num_items_in_batch`: batch * (length - 1) here). The own loop does the same;
with the model's own loss instead, the losses part at step 5 (bf16_master) or 0
(amp_fp16).
Nothing is downloaded: the data are token ids (`skip_prepare_dataset`) and the
tokenizer SFTTrainer asks for is a 256-token word-level one built here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

trl = pytest.importorskip("trl", reason="the TRL tests need trl (the dev extra)")
datasets = pytest.importorskip("datasets", reason="the TRL tests need datasets (trl's)")
tokenizers = pytest.importorskip("tokenizers", reason="the TRL tests need tokenizers")

from test_hf import (  # noqa: E402
    DATA,
    STEPS,
    LossRecordingTrainer,
    assert_equal,
    make_model,
    make_policy,
    own_loop,
    trainer_state,
    training_settings,
    transformers,
)

from mixprec.integrations.hf import PrecisionTrainerMixin  # noqa: E402

#: The per-token outputs SFTTrainer asks of its fused LM head (TRL 1.16, `SFTTrainer.__init__`).
SFT_OUTPUTS = ("log_probs", "entropy", "is_top1")


class PrecisionSFTTrainer(PrecisionTrainerMixin, LossRecordingTrainer, trl.SFTTrainer):
    """The mixin on TRL's SFTTrainer; test_hf's recorder (losses, a NaN step) in between."""


def byte_tokenizer() -> Any:
    """A local tokenizer of the model's 256 token ids (SFTTrainer would otherwise fetch one)."""
    vocab = {f"<{i}>": i for i in range(256)}
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<0>"))
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=model, eos_token="<0>", pad_token="<0>"
    )


def make_sft_trainer(
    out: str, policy: str = "bf16_master", *, nan_step: int | None = None, **args: Any
) -> PrecisionSFTTrainer:
    settings: dict[str, Any] = {
        **training_settings(out),
        "bf16": False,  # SFTConfig's default is True: the policy sets the precision
        "dataset_kwargs": {"skip_prepare_dataset": True},  # the rows are token ids already
        "remove_unused_columns": False,
        **args,
    }
    return PrecisionSFTTrainer(
        model=make_model(),
        args=trl.SFTConfig(**settings),
        train_dataset=datasets.Dataset.from_dict({"input_ids": DATA.tolist()}),
        processing_class=byte_tokenizer(),
        precision=make_policy(policy),
        nan_step=nan_step,
    )


def fused_model(lora: bool) -> torch.nn.Module:
    """test_hf's model with the fused LM head SFTTrainer installs."""
    model = make_model(lora)
    trl.trainer.utils.add_fused_lm_head(model, outputs=SFT_OUTPUTS)
    return model


def sft_loss(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """SFTTrainer.compute_loss on a batch of the collator's (labels = inputs, mask of ones)."""
    out = model(
        input_ids=x,
        attention_mask=torch.ones_like(x),
        labels=x,
        use_cache=False,
        fused_lm_head=True,
    )
    # Trainer's count over labels[..., 1:], over its parallel sizes (1 here): a float tensor
    num_items_in_batch = (x[:, 1:] != -100).sum() / 1
    loss: torch.Tensor = -out.log_probs.sum() / num_items_in_batch.clamp(min=1)
    return loss


@pytest.mark.parametrize("policy", ["bf16_master", "amp_fp16"])
def test_sft_trainer_matches_own_loop_bitwise(policy: str, tmp_path: Path) -> None:
    trainer = make_sft_trainer(str(tmp_path), policy)
    trainer.train()
    # SFTConfig's own default: activations were recomputed in the backward (not in the loop).
    assert trainer.model.is_activation_checkpointing
    got = trainer_state(trainer)
    assert_equal(got, own_loop(policy, make=fused_model, loss_of=sft_loss))
    # The comparison sees the loss: the model's own loss parts from SFTTrainer's in the bits.
    assert got["losses"] != own_loop(policy)["losses"]
    assert trainer.precision.stats.steps == STEPS == len(got["losses"])
    if policy == "amp_fp16":  # test_hf's scale: several steps skip, the scheduler holds
        assert 0 < got["skipped"][-1] < STEPS // 2
        assert len(set(got["lrs"])) < STEPS - 1
    else:
        assert got["skipped"][-1] == 0
        weights = {p.dtype for n, p in trainer.model.named_parameters() if "norm" not in n}
        assert weights == {torch.bfloat16}


def test_sft_nan_step_is_skipped_logged_and_holds_the_scheduler(tmp_path: Path) -> None:
    trainer = make_sft_trainer(str(tmp_path), nan_step=5)
    trainer.train()
    got = trainer_state(trainer)
    assert_equal(got, own_loop("bf16_master", nan_step=5, make=fused_model, loss_of=sft_loss))
    assert got["skipped"][4:7] == [0, 1, 1]
    assert got["lrs"][5] == got["lrs"][6] != got["lrs"][7]
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


@pytest.mark.parametrize("flag", ["fp16", "bf16"])
def test_sft_config_precision_flags_are_refused(flag: str, tmp_path: Path) -> None:
    with pytest.raises(
        ValueError,
        match=rf"^SFTConfig\({flag}=True\) contradicts the mixprec policy 'bf16_master'"
        r".*set fp16=False and bf16=False$",
    ):
        make_sft_trainer(str(tmp_path), **{flag: True})


def test_sft_config_default_bf16_is_refused(tmp_path: Path) -> None:
    # bf16=None is SFTConfig's default, which turns bf16 on: the message says to turn it off.
    with pytest.raises(ValueError, match=r"^SFTConfig\(bf16=True\) contradicts.*bf16=False$"):
        make_sft_trainer(str(tmp_path), bf16=None)
