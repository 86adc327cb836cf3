"""Built-in real workloads (Shakespeare char-LM, digits) and user workloads by `module:function`."""

from mixprec.workloads.base import (
    AutocastFactory,
    BatchFn,
    EvalResult,
    EvaluateFn,
    LossFn,
    ModelFn,
    Workload,
    batch_generator,
    evaluation_mode,
    model_device,
    seeded_init,
)
from mixprec.workloads.digits import DIGITS_SIZES, DigitsConfig, digits_workload
from mixprec.workloads.gpt import GPT, GPTConfig
from mixprec.workloads.metrics import accuracy, bits_per_char, macro_f1
from mixprec.workloads.plays import DEFAULT_HELD_OUT_PLAYS, CharVocab, available_plays
from mixprec.workloads.registry import WORKLOADS, load_workload, workload_names
from mixprec.workloads.settings import TrainDefaults, TrainSettings, lr_at
from mixprec.workloads.shakespeare import (
    SHAKESPEARE_SIZES,
    ShakespeareConfig,
    shakespeare_workload,
)

__all__ = [
    "DEFAULT_HELD_OUT_PLAYS",
    "DIGITS_SIZES",
    "GPT",
    "SHAKESPEARE_SIZES",
    "WORKLOADS",
    "AutocastFactory",
    "BatchFn",
    "CharVocab",
    "DigitsConfig",
    "EvalResult",
    "EvaluateFn",
    "GPTConfig",
    "LossFn",
    "ModelFn",
    "ShakespeareConfig",
    "TrainDefaults",
    "TrainSettings",
    "Workload",
    "accuracy",
    "available_plays",
    "batch_generator",
    "bits_per_char",
    "digits_workload",
    "evaluation_mode",
    "load_workload",
    "lr_at",
    "macro_f1",
    "model_device",
    "seeded_init",
    "shakespeare_workload",
    "workload_names",
]
