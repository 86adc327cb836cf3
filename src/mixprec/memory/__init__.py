"""Memory and communication accounting: predicted and measured, by component.

"Half the memory" claims fail because they count activations and forget masters,
moments, gradients and communication. `estimate` predicts every component for a
policy; `measure` measures the same components on a real step by walking the
tensors that exist, so the two can be compared.

One module per concept:

* `breakdown`: the components (`COMPONENTS`, `Components`, `MemoryBreakdown`);
* `estimation`: the analytic prediction (`estimate`), with communication per step;
* `state_layout`: optimizer-state bytes per tensor from the formats' layout;
* `activations`: bytes saved for backward, and which parameters get a gradient, from
  a fake forward (`fake_forward`, `saved_activation_bytes`);
* `fp8`: FP8 linears: what torchao saves, the casts' temporaries replayed per layer
  (`fp8_layer_transients`) and measured (`fp8_transient_windows`);
* `transients`: memory allocated and freed inside windows of a real step (`LiveBytes`);
* `transformer`: `TransformerShape`, a decoder-only transformer from its config;
* `measurement`: real tensors (`measure`, `optimizer_state_bytes`, `training_state_bytes`).
"""

from mixprec.memory.activations import FakeForward, fake_forward, saved_activation_bytes
from mixprec.memory.breakdown import (
    COMPONENTS,
    Components,
    Fp8Memory,
    MemoryBreakdown,
    Sharding,
    format_bytes,
)
from mixprec.memory.estimation import estimate
from mixprec.memory.fp8 import FP8_RECIPE_CASTS, fp8_layer_transients, fp8_transient_windows
from mixprec.memory.measurement import (
    MASTER_STATE_KEYS,
    MOMENT_STATE_KEYS,
    measure,
    optimizer_state_bytes,
    optimizer_state_nbytes,
    training_state_bytes,
)
from mixprec.memory.optimizer_rule import OPTIMIZER_NAMES, optimizer_rule
from mixprec.memory.state_layout import INT8_BLOCK_SIZE, INT8_MIN_NUMEL, state_nbytes
from mixprec.memory.transformer import TransformerShape
from mixprec.memory.transients import LiveBytes

__all__ = [
    "COMPONENTS",
    "FP8_RECIPE_CASTS",
    "INT8_BLOCK_SIZE",
    "INT8_MIN_NUMEL",
    "MASTER_STATE_KEYS",
    "MOMENT_STATE_KEYS",
    "OPTIMIZER_NAMES",
    "Components",
    "FakeForward",
    "Fp8Memory",
    "LiveBytes",
    "MemoryBreakdown",
    "Sharding",
    "TransformerShape",
    "estimate",
    "fake_forward",
    "format_bytes",
    "fp8_layer_transients",
    "fp8_transient_windows",
    "measure",
    "optimizer_rule",
    "optimizer_state_bytes",
    "optimizer_state_nbytes",
    "saved_activation_bytes",
    "state_nbytes",
    "training_state_bytes",
]
