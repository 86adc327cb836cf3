"""Each static rule's fix, spelled in the setup's own terms (`TrainingFacts.dialect`).

A finding on an HF Trainer recipe names ``torch_dtype``/``bf16``/``optim``; one
on a DeepSpeed JSON names ``bf16.enabled`` and ``communication_data_type``; a
mixprec config gets presets and ``precision.*`` keys; live objects get mixprec's
API. One function per rule, each a table by dialect (with a dialect-neutral
fallback that names no other tool's keys), so the rules keep only their logic.
"""

from __future__ import annotations

from mixprec.doctor.facts import Dialect, TrainingFacts

__all__ = [
    "accelerated_fix",
    "compute_in",
    "fp8_fix",
    "fp8_speed_fix",
    "master_fix",
    "master_unneeded_fix",
    "mixprec_counterpart",
    "moments_fix",
    "reduce_fix",
    "scaler_unneeded_fix",
    "storage_fix",
    "unscaled_fp16_fix",
]

_STORAGE: dict[Dialect, str] = {
    "nemo": (
        "keep bf16 storage with a master: optimizer._target_: "
        "transformer_engine.pytorch.optimizers.fused_adam.FusedAdam with master_weights: "
        "true, store_param_remainders: true, exp_avg_dtype: torch.float32, "
        "exp_avg_sq_dtype: torch.float32; or store parameters in fp32 (model.torch_dtype: "
        "float32) and compute in bf16 through distributed.mp_policy.param_dtype: bfloat16"
    ),
    "torchtitan": (
        'keep [training] dtype = "float32" (the default): FSDP2 then computes in '
        "mixed_precision_param (bf16) over fp32 sharded weights, and the optimizer's state "
        "is fp32"
    ),
    "lightning": (
        "set trainer.precision: bf16-mixed (fp32 weights and optimizer state, bf16 autocast) "
        "instead of a *-true precision"
    ),
    "hf": (
        "load the model in float32 (torch_dtype: float32, or leave it unset: TRL's default) "
        "and keep bf16: true, so the weights and the optimizer's state stay fp32 and matmuls "
        "run in bf16; or keep bf16 weights under a launcher that keeps fp32 masters: "
        "deepspeed: <ds_config.json> (bf16.enabled) or fsdp: full_shard with bf16: true"
    ),
    "deepspeed": (
        "keep bf16.enabled: true (or fp16.enabled) without bf16_master_weights_and_grads, "
        "bf16_optimizer_states and fp16_master_weights_and_grads: DeepSpeed then keeps an fp32 "
        "master partition and fp32 optimizer states"
    ),
    "accelerate": (
        "on TPU, mixed_precision: bf16 sets XLA_USE_BF16=1 (XLA_DOWNCAST_BF16=1 with "
        "downcast_bf16), which makes the weights and the optimizer's state bf16: set "
        "mixed_precision: 'no' and autocast to bf16 in the training script "
        "(torch.autocast('xla', dtype=torch.bfloat16)), keeping both in fp32"
    ),
    "axolotl": (
        "bf16: true loads the weights in bf16: for a full fine-tune use DeepSpeed "
        "(deepspeed: deepspeed_configs/zero2.json, an fp32 master partition) or FSDP version "
        "1 (fsdp_version: 1 with fsdp_config: Accelerate upcasts trainable weights to fp32 "
        "under bf16 mixed precision; axolotl's own FSDP2 preparation does not), or train "
        "adapters (adapter: lora)"
    ),
    "litgpt": (
        "set precision: bf16-mixed (fp32 weights, adapters and optimizer state, bf16 "
        "autocast) "
        "instead of bf16-true; with quantize (LitGPT allows only *-true there) use 32-true, "
        "which keeps the LoRA adapters in fp32"
    ),
}
_EXACT = "an exact master: bitwise the fp32 update for 2 extra bytes/param"
_FP32_LIVE = (
    "or keep the parameters in fp32 and compute in bf16 under autocast (Precision('amp_bf16'))"
)


def mixprec_counterpart(name: str) -> str | None:
    """The `mixprec.optim` class with the update rule of the optimizer named `name`
    (``torch.optim.SGD``, ``sgd``, ``bitsandbytes.optim.Lion8bit``, ``adamw_torch``):
    ``AdamW``, ``Adam``, ``SGD`` or ``Lion``; None for one mixprec has no rule for
    (Muon, Adafactor, RMSprop, ...: `mixprec.optim.Mastered` wraps those)."""
    last = name.rsplit(".", 1)[-1].lower()
    if "lion" in last:
        return "Lion"
    if last == "sgd" or last.startswith("sgd_"):
        return "SGD"
    if "adamw" in last or last == "fusedadam":  # TE's FusedAdam: adam_w_mode=True
        return "AdamW"
    if "adam" in last and last not in ("nadam", "radam", "adamax", "sparseadam"):
        return "Adam"
    return None


def master_fix(name: str) -> str:
    """How to give the optimizer named `name` a full-precision master in mixprec's API:
    mixprec's class with the same rule, else ``Mastered`` around the torch class."""
    cls = mixprec_counterpart(name)
    if cls == "AdamW":
        return (
            "optimize with mixprec.optim.AdamW(params, master='exact', moments='fp32') (what "
            "Precision('bf16_master').optimizer(model) builds)"
        )
    if cls is not None:
        return (
            f"optimize with mixprec.optim.{cls}(params, ..., master='exact') (the same rule "
            f"and arguments over {_EXACT})"
        )
    return _mastered(name)


def _mixprec_storage(name: str) -> str:
    """The mixprec config's fix: preset bf16_master, and mixprec's optimizer of the rule
    (a torch optimizer without one is wrapped in ``Mastered`` in code: the config names
    only mixprec's own classes)."""
    cls = mixprec_counterpart(name)
    with_optimizer = (
        f"with optimizer.name: {cls.lower()} (mixprec.optim.{cls})"
        if cls is not None
        else f"and, in the training script, {_mastered(name)}"
    )
    return (
        "use precision preset bf16_master (bf16 storage, master: exact = bitwise fp32 for "
        f"2 extra bytes/param, optimizer state in fp32) {with_optimizer}, or keep "
        "parameters in fp32 (preset amp_bf16)"
    )


def _mastered(name: str) -> str:
    """``Mastered`` around the torch optimizer `name` (it takes the class, in code)."""
    torch_cls = name if name.startswith("torch.optim.") else "<the torch optimizer class>"
    return (
        f"wrap the torch optimizer: mixprec.optim.Mastered({torch_cls}, params, "
        f"master='exact', ...) steps it unmodified on fp32 values decoded from {_EXACT}"
    )


def _nemo_storage(name: str) -> str:
    """The NeMo recipe's fix: TE's FusedAdam with remainders for the Adam family, else
    mixprec's optimizer of the rule as the ``_target_`` (or ``Mastered``, in code)."""
    cls = mixprec_counterpart(name)
    if cls in ("AdamW", "Adam") or (cls is None and "adam" in name.lower()):
        return _STORAGE["nemo"]
    master = (
        f"optimizer._target_: mixprec.optim.{cls} with master: exact (bitwise fp32 updates "
        "for 2 extra bytes/param)"
        if cls is not None
        else _mastered(name)
    )
    return (
        f"keep bf16 storage with a master: {master}; or store parameters in fp32 "
        "(model.torch_dtype: float32) and compute in bf16 through "
        "distributed.mp_policy.param_dtype: bfloat16"
    )


def storage_fix(facts: TrainingFacts) -> str:
    """`optimizer-state-16bit`: a full-precision master for the optimizer at hand (its
    mixprec counterpart, or ``Mastered``), or fp32 storage."""
    name = facts.optimizer.name if facts.optimizer is not None else "AdamW"
    if facts.peft and facts.dialect == "hf":
        return (
            "for QLoRA, TRL casts the trainable adapter weights of a quantized model to bf16 "
            "(sft_trainer.py): drop load_in_4bit/load_in_8bit to keep fp32 adapters (PEFT "
            "upcasts them), or keep the run short"
        )
    if facts.peft and facts.dialect == "axolotl":
        return (
            "remove peft_autocast_adapter_dtype: false: PEFT then keeps the adapter weights "
            "(and the optimizer's state) in fp32"
        )
    if facts.dialect == "mixprec":
        return _mixprec_storage(name)
    if facts.dialect == "nemo":
        return _nemo_storage(name)
    return _STORAGE.get(facts.dialect, f"{master_fix(name)}, {_FP32_LIVE}")


_MOMENTS: dict[Dialect, str] = {
    "mixprec": "set optimizer.moments: fp32 (or int8, blockwise) if the loss plateaus early",
    "nemo": (
        "set exp_avg_dtype: torch.float32 and exp_avg_sq_dtype: torch.float32 if the loss "
        "plateaus early"
    ),
}


def moments_fix(facts: TrainingFacts) -> str:
    """`optimizer-state-16bit` (info): a master, but 16-bit moments."""
    return _MOMENTS.get(
        facts.dialect, "store the moments in fp32 (or int8 blockwise) if the loss plateaus early"
    )


def compute_in(facts: TrainingFacts, dtype: str) -> str:
    """How the setup asks for `dtype` (``"bf16"`` or ``"fp16"``) compute, in its terms."""
    long = {"bf16": "bfloat16", "fp16": "float16"}.get(dtype, dtype)
    spelled: dict[Dialect, str] = {
        "mixprec": f"precision.compute_dtype: {dtype} (preset amp_{dtype})",
        "nemo": f"distributed.mp_policy.param_dtype: {long}",
        "hf": f"{dtype}: true",
        "axolotl": f"{dtype}: true",
        "deepspeed": f"{dtype}.enabled: true",
        "accelerate": f"mixed_precision: {dtype}",
        "lightning": f"trainer.precision: {'16' if dtype == 'fp16' else dtype}-mixed",
        "torchtitan": f'[training] mixed_precision_param = "{long}"',
    }
    return spelled.get(facts.dialect, f"Precision('amp_{dtype}')")


_UNSCALED: dict[Dialect, str] = {
    "nemo": (
        "compute in bf16 (distributed.mp_policy.param_dtype: bfloat16), which has fp32's "
        "range and needs no scaling; this recipe declares no loss scaler"
    ),
    "mixprec": "use preset amp_fp16 (dynamic loss scaling) or compute in bf16 (amp_bf16)",
    "hf": (
        "load the model in float32 (torch_dtype: float32) and set fp16: true (fp16 autocast "
        "with a GradScaler), or use bf16: true where the hardware has bf16"
    ),
    "axolotl": (
        "use fp16: true (fp16 autocast with a GradScaler through the HF Trainer) instead of "
        "float16: true, or bf16: true"
    ),
    "deepspeed": (
        "set fp16.loss_scale: 0 (dynamic loss scaling, DeepSpeed's default) or a static scale "
        "well above 1, or train in bf16 (bf16.enabled: true instead of fp16.enabled)"
    ),
    "lightning": (
        "set trainer.precision: 16-mixed (fp32 weights, fp16 autocast with a GradScaler) or "
        "bf16-mixed instead of 16-true"
    ),
    "torchtitan": (
        "torchtitan has no loss scaler: compute in bf16 ([training] mixed_precision_param = "
        '"bfloat16", the default; dtype = "float32")'
    ),
    "accelerate": "use mixed_precision: fp16 (it adds a GradScaler) or mixed_precision: bf16",
}


def unscaled_fp16_fix(facts: TrainingFacts) -> str:
    """`fp16-without-loss-scaling`: dynamic loss scaling, or bf16 compute."""
    if facts.loss_scaling_off_by:
        return (
            f"remove `{facts.loss_scaling_off_by}`: it turns off the dynamic loss scaling "
            "the preset already has"
        )
    return _UNSCALED.get(
        facts.dialect,
        "scale the loss: Precision('amp_fp16') or torch.amp.GradScaler; or compute in bf16 "
        "(Precision('amp_bf16'))",
    )


_SCALER: dict[Dialect, str] = {
    "mixprec": "drop the scaler: precision.loss_scaling: null (bf16 and fp32 need none)",
    "nemo": "drop the loss scaler",
    "live": "drop the scaler (torch.amp.GradScaler(enabled=False), or a policy without one)",
    "axolotl": "remove fp16: true beside bf16: true (bf16 needs no GradScaler)",
}


def scaler_unneeded_fix(facts: TrainingFacts) -> str:
    """`loss-scaling-unneeded`: drop the scaler."""
    return _SCALER.get(facts.dialect, "drop the loss scaler")


_REDUCE: dict[Dialect, str] = {
    "nemo": (
        "reduce in fp32: distributed.mp_policy.reduce_dtype: float32 (FSDP2), or "
        "grad_reduce_in_fp32: true (Megatron FSDP)"
    ),
    "mixprec": "set distributed.reduce_dtype: fp32 (mixprec's default)",
    "live": "use a policy with reduce_dtype=torch.float32 (mixprec's default)",
    "deepspeed": (
        'set "communication_data_type": "fp32" (unset, DeepSpeed communicates gradients in '
        "the training dtype)"
    ),
    "accelerate": (
        "the launch config cannot set it: with DeepSpeed, point deepspeed_config_file at a "
        "DeepSpeed JSON with communication_data_type: fp32; with FSDP, pass "
        "FullyShardedDataParallelPlugin(mixed_precision_policy={'param_dtype': torch.bfloat16, "
        "'reduce_dtype': torch.float32}) to the Accelerator in the script; on TPU, "
        "mixed_precision: 'no' with bf16 autocast in the script"
    ),
    "lightning": (
        "with trainer.strategy: fsdp, Lightning's FSDP precision plugin reduces in the "
        "precision's dtype: give FSDPStrategy an explicit mixed_precision "
        "(torch.distributed.fsdp.MixedPrecision with reduce_dtype=torch.float32); with ddp, "
        "use trainer.precision: bf16-mixed (fp32 weights, so fp32 gradients)"
    ),
    "torchtitan": (
        'reduce in fp32: [training] mixed_precision_reduce = "float32" (torchtitan\'s '
        'default) under FSDP; under DDP keep [training] dtype = "float32"'
    ),
}


def reduce_fix(facts: TrainingFacts) -> str:
    """`reduce-dtype-16bit`: reduce gradients in fp32."""
    return _REDUCE.get(facts.dialect, "reduce gradients across ranks in fp32")


_MASTER: dict[Dialect, str] = {
    "mixprec": (
        "drop the master (optimizer.master: none, or a preset without one such as amp_bf16), "
        "or store the parameters in bf16 (precision.param_dtype: bf16) if memory is the goal"
    ),
    "nemo": (
        "drop the master (master_weights: false in the optimizer's kwargs), or store the "
        "parameters in bf16 (model.torch_dtype: bfloat16) if memory is the goal"
    ),
    "live": (
        "drop the master (master='none' in the mixprec optimizer), or store the parameters "
        "in bf16 if memory is the goal"
    ),
}


def master_unneeded_fix(facts: TrainingFacts) -> str:
    """`master-without-16bit-params`: drop the master, or store 16-bit parameters."""
    return _MASTER.get(
        facts.dialect,
        "drop the optimizer's master copy, or store the parameters in bf16 if memory is the goal",
    )


def accelerated_fix(facts: TrainingFacts, better: str | None, device: str) -> str:
    """`format-not-accelerated`: a format the device runs fast (`better`), or fp32."""
    if better is not None:
        return f"compute in {better}, which is accelerated on {device}: {compute_in(facts, better)}"
    if facts.dialect == "mixprec":
        return "compute in fp32 here (preset 'auto' picks the fastest correct format)"
    if facts.dialect == "live":
        return "compute in fp32 here (Precision('auto') picks the fastest correct format)"
    return "compute in fp32 here: turn the 16-bit setting off"


_FP8: dict[Dialect, str] = {
    "mixprec": (
        "set fp8.scaling: tensorwise (or rowwise; torchao float8) and keep the parameters in "
        "bf16/fp32"
    ),
    "nemo": (
        "use fp8 through a scaled recipe (fp8: {enabled: true, recipe_name: tensorwise} or "
        "rowwise; Transformer Engine recipes through model.backend.te_fp8) and keep "
        "model.torch_dtype bfloat16/float32"
    ),
    "hf": (
        "load the model in bfloat16 or float32 (torch_dtype), and train in fp8 only through a "
        "scaled recipe (an Accelerate launch config with mixed_precision: fp8)"
    ),
}


def fp8_fix(facts: TrainingFacts) -> str:
    """`fp8-without-scaling`: a scaled fp8 recipe over bf16/fp32 parameters."""
    return _FP8.get(
        facts.dialect,
        "use fp8 through a scaled recipe (torchao float8 'tensorwise'/'rowwise', Transformer "
        "Engine recipes) and keep parameters in bf16/fp32",
    )


def fp8_speed_fix(facts: TrainingFacts) -> str:
    """`format-not-accelerated` for fp8: judge numerics here, measure speed on FP8 units."""
    turn_off = {
        "nemo": " with fp8.emulate: false",
        "torchtitan": " with [quantize.linear.float8] emulate = false",
    }.get(facts.dialect, " without emulation")
    return (
        "use this run for fp8 numerics only; measure fp8 speed on a GPU with FP8 units (CUDA "
        f"capability 8.9+: Ada, Hopper, Blackwell){turn_off}"
    )
