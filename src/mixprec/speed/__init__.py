"""Measured speed of the compute formats on this device: what ``auto`` decides from.

CPU flags and GPU generations say whether a format has hardware; they do not say
whether a model's step is faster in it at the model's sizes (small matmuls and
the casts around them can make bf16 autocast slower than fp32 on a CPU with
AVX512-BF16). `measure_speed` times the step itself. One module per concept:

* `timing`: the injectable timer, warm-up and interleaved repeats;
* `targets`: the step of each format on a model (left untouched) or on matmul shapes;
* `cache`: measured times on disk, keyed by device, torch, threads and shapes;
* `decide`: the choice, a pure function of the times (`choose_format`);
* `measure`: `measure_speed` and its result, `SpeedMeasurement`.

The presets the choice maps to live in `mixprec.policy` (`resolve_auto`).
"""

from mixprec.speed.cache import CACHE_ENV, CACHE_MODES, CacheMode, cache_mode, speed_cache_dir
from mixprec.speed.decide import (
    CANDIDATE_FORMATS,
    DEFAULT_MARGIN,
    choose_agreed,
    choose_format,
    ratios,
)
from mixprec.speed.measure import (
    MAX_STEPS_PER_FORMAT,
    CacheStatus,
    SpeedMeasurement,
    measure_speed,
)
from mixprec.speed.targets import (
    LossFn,
    MatmulShape,
    default_loss,
    format_shapes,
    matmul_model,
    parse_shapes,
)
from mixprec.speed.timing import Step, StepTimer, time_interleaved, wall_clock_timer

__all__ = [
    "CACHE_ENV",
    "CACHE_MODES",
    "CANDIDATE_FORMATS",
    "DEFAULT_MARGIN",
    "MAX_STEPS_PER_FORMAT",
    "CacheMode",
    "CacheStatus",
    "LossFn",
    "MatmulShape",
    "SpeedMeasurement",
    "Step",
    "StepTimer",
    "cache_mode",
    "choose_agreed",
    "choose_format",
    "default_loss",
    "format_shapes",
    "matmul_model",
    "measure_speed",
    "parse_shapes",
    "ratios",
    "speed_cache_dir",
    "time_interleaved",
    "wall_clock_timer",
]
