"""The runtime: `Precision` runs a training loop under a policy, read once into a plan.

One module per concept (tests mirror it in ``tests/engine/``):

* `plan`: `PrecisionPlan`, the policy resolved once (`resolve_plan`);
* `precision`: `Precision` (prepare, autocast, backward, clip, step, state);
* `storage`: what `prepare` does to a model (fp32 islands, storage casts);
* `fp8`: FP8 linear layers through torchao's float8 training (which layers, the
  conversion, `Float8Conversion` on `Precision.fp8`, the lazy torchao import);
* `effective`: requested versus effective precision on a device;
* `optimizers`: the optimizer a plan implies, and whether one can honour it;
* `scaling`: loss scaling and unscaling before clipping;
* `accumulation`: the gradient hooks that catch a backward outside `Precision.backward`;
* `stepping`: one decision for every optimizer, non-finite steps skipped;
* `state`: saved state, validated before anything changes;
* `observers`: the `StepObserver` protocol;
* `gradients`: small helpers over gradients and optimizers.

`StepReport` and `PrecisionStats` live in `mixprec.telemetry` and are re-exported here.
"""

from mixprec.engine.observers import StepObserver
from mixprec.engine.plan import PrecisionPlan, resolve_plan
from mixprec.engine.precision import Precision
from mixprec.telemetry import PrecisionStats, StepReport

__all__ = [
    "Precision",
    "PrecisionPlan",
    "PrecisionStats",
    "StepObserver",
    "StepReport",
    "resolve_plan",
]
