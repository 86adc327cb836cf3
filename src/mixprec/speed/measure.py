"""`measure_speed`: time each compute format's training step on this device, cached.

The result, a `SpeedMeasurement`, is plain data: the samples of each measured
format, the formats left out and why, where the numbers came from (measured now,
or the cache). `SpeedMeasurement.choice` applies `choose_format`;
`mixprec.policy.resolve_auto(measured=...)` turns it into a preset.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from mixprec.device import DeviceCaps, device_caps
from mixprec.speed.cache import cache_mode, entry_path, read_entry, write_entry
from mixprec.speed.decide import CANDIDATE_FORMATS, DEFAULT_MARGIN, choose_agreed, ratios
from mixprec.speed.targets import (
    LossFn,
    MatmulShape,
    describe_model,
    format_shapes,
    matmul_model,
    model_signature,
    model_steps,
    parse_shapes,
)
from mixprec.speed.timing import (
    StepTimer,
    best_times,
    median_times,
    time_interleaved,
    wall_clock_timer,
)

__all__ = [
    "MAX_STEPS_PER_FORMAT",
    "CacheStatus",
    "SpeedMeasurement",
    "measure_for_auto",
    "measure_speed",
]

#: Where a measurement's numbers came from: ``hit`` (the cache), ``miss`` (measured,
#: stored), ``corrupt`` (a bad entry was ignored; measured, stored), ``refresh``
#: (measured again, stored), ``off`` (measured, not stored), ``unwritable`` (measured,
#: the cache folder could not be written).
CacheStatus = Literal["hit", "miss", "corrupt", "refresh", "off", "unwritable"]


@dataclass(frozen=True, kw_only=True)
class SpeedMeasurement:
    """Measured training-step times of the compute formats on one device.

    Attributes:
        device: the device measured on, e.g. ``"cpu"`` or ``"cuda:0"``.
        device_name: its name (`DeviceCaps.name`).
        target: what was timed, e.g. ``"GPT (0.11M params), input (32, 64) int64"``.
        threads: `torch.get_num_threads()` during the measurement.
        torch_version: ``torch.__version__``.
        warmup: untimed steps per format before the timed ones.
        repeats: timed steps per format (interleaved rounds).
        samples: seconds per step of each measured format (``"fp32"`` always).
        skipped: formats not measured, with the reason.
        cache: where the numbers came from (`CacheStatus`).
        cache_path: the cache entry read or written, if any.
    """

    device: str
    device_name: str
    target: str
    threads: int
    torch_version: str
    warmup: int
    repeats: int
    samples: dict[str, tuple[float, ...]]
    skipped: dict[str, str] = field(default_factory=dict)
    cache: CacheStatus = "off"
    cache_path: str | None = None

    def __post_init__(self) -> None:
        order = {name: i for i, name in enumerate(CANDIDATE_FORMATS)}
        samples = sorted(self.samples.items(), key=lambda item: order.get(item[0], len(order)))
        object.__setattr__(self, "samples", {k: tuple(v) for k, v in samples})
        object.__setattr__(self, "skipped", dict(self.skipped))
        ratios(self.times())  # validates: fp32 present, known formats, positive times

    def times(self) -> dict[str, float]:
        """The step time (seconds) of each measured format: its fastest sample (load
        from other processes only adds time)."""
        return best_times(self.samples)

    def medians(self) -> dict[str, float]:
        """The median step time (seconds) of each measured format, for reports."""
        return median_times(self.samples)

    def ratios(self) -> dict[str, float]:
        """Each measured format's step time (`times`) over fp32's."""
        return ratios(self.times())

    def median_ratios(self) -> dict[str, float]:
        """Each measured format's median step time over fp32's median."""
        return ratios(self.medians())

    def choice(self, *, margin: float = DEFAULT_MARGIN) -> str:
        """fp32, bf16 or fp16: the format both the fastest and the median samples
        justify (`choose_agreed`): a 16-bit format needs the margin by both."""
        return choose_agreed(self.times(), self.medians(), margin=margin)

    def explain(self, *, margin: float = DEFAULT_MARGIN) -> str:
        """What was measured, in one line: the ratios, how, and what was left out."""
        kind = {"cpu": "CPU", "cuda": "GPU"}.get(self.device.split(":")[0], self.device)
        medians = self.median_ratios()
        steps = ", ".join(
            f"{name} autocast step {ratio:.2f}x fp32's (median {medians[name]:.2f}x)"
            for name, ratio in self.ratios().items()
            if name != "fp32"
        )
        how = (
            f"{self.target}; forward+backward, best and median of {self.repeats} interleaved "
            f"steps{'' if kind != 'CPU' else f', {_threads(self.threads)}'}"
            f"{', from the cache' if self.cache == 'hit' else ''}; "
            f"a 16-bit format needs <= {1 - margin:.2f}x by both"
        )
        text = (
            f"{steps} on this {kind} at these shapes ({how})"
            if steps
            else f"only fp32 measured on this {kind} ({how})"
        )
        left_out = "; ".join(f"{name} not measured: {why}" for name, why in self.skipped.items())
        return f"{text}; {left_out}" if left_out else text

    def to_dict(self, *, margin: float = DEFAULT_MARGIN) -> dict[str, Any]:
        """A JSON-ready dict: the fields, the best and median times, the ratios, the choice."""
        return {
            **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)},
            "samples": {k: list(v) for k, v in self.samples.items()},
            "best_s": self.times(),
            "median_s": self.medians(),
            "ratio_to_fp32": self.ratios(),
            "median_ratio_to_fp32": self.median_ratios(),
            "margin": margin,
            "choice": self.choice(margin=margin),
        }


def _threads(count: int) -> str:
    return "1 thread" if count == 1 else f"{count} threads"


def _device_of(model: nn.Module) -> torch.device:
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return torch.device("cpu")


def _candidates(
    caps: DeviceCaps, formats: Sequence[str] | None
) -> tuple[list[str], dict[str, str]]:
    """The formats to measure, and those left out with why.

    By default a 16-bit format is measured only where the device has hardware for
    it (`DeviceCaps.fast`): emulated matmuls cannot beat native fp32 ones (measured
    30-100x slower for fp16 on a CPU without AVX512-FP16), and one emulated step at a
    large shape would take minutes. Formats named explicitly are measured wherever
    autocast supports them.
    """
    explicit = formats is not None
    wanted = list(CANDIDATE_FORMATS if formats is None else formats)
    unknown = [name for name in wanted if name not in CANDIDATE_FORMATS]
    if unknown or not wanted:
        raise ValueError(
            f"formats must name some of {', '.join(CANDIDATE_FORMATS)}, got {list(wanted)}"
        )
    measured, skipped = ["fp32"], {}
    for name in CANDIDATE_FORMATS[1:]:
        if name not in wanted:
            continue
        if not caps.supported(name):
            skipped[name] = f"autocast cannot compute in it here ({caps.reason(name)})"
        elif not explicit and not caps.fast(name):
            skipped[name] = caps.reason(name)
        else:
            measured.append(name)
    return measured, skipped


#: Most warm-up or timed steps per format a measurement takes (a guard against typos:
#: the median of a few interleaved steps is already stable).
MAX_STEPS_PER_FORMAT = 1000


def _check_count(name: str, value: int, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if value > MAX_STEPS_PER_FORMAT:
        raise ValueError(f"{name} must be at most {MAX_STEPS_PER_FORMAT}, got {value!r}")


def measure_speed(
    model: nn.Module | None = None,
    example_input: Any = None,
    *,
    shapes: str | Sequence[str] | Sequence[MatmulShape] | None = None,
    loss_fn: LossFn | None = None,
    device: torch.device | str | None = None,
    formats: Sequence[str] | None = None,
    warmup: int = 1,
    repeats: int = 5,
    label: str | None = None,
    cache: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    timer: StepTimer | None = None,
    should_stop: Callable[[], bool] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> SpeedMeasurement:
    """Time a training step (forward and backward) in fp32, bf16 and fp16 autocast here.

    Give either a model and an example input (the model is not changed: see
    `mixprec.speed.targets`), or matmul shapes. Steps run with the thread count
    torch uses now, under a forked RNG (the global RNG state is restored).

    Args:
        model: the model to time, on the device to time it on.
        example_input: its input (a tuple is the positional arguments, a mapping the
            keyword arguments, anything else the one argument).
        shapes: instead of a model: ``"MxNxK"`` strings (or comma-separated lists of
            them) or `MatmulShape`s, each timed as a linear layer's training step.
        loss_fn: reduces the model's output to the loss (default: the mean of the
            first floating tensor in it, upcast to fp32).
        device: where to time (default: the model's device; for shapes, CUDA when
            available, else CPU).
        formats: the formats to measure (default: fp32 and each 16-bit format this
            device has hardware for; fp32 is always measured).
        warmup: untimed steps per format first.
        repeats: timed steps per format, in interleaved rounds.
        label: a name for what is timed, shown in the explanation (e.g. a workload).
        cache: ``"use"``, ``"refresh"`` or ``"off"`` (default ``$MIXPREC_SPEED_CACHE``,
            else ``"use"``); see `mixprec.speed.cache`.
        cache_dir: the cache folder (default: ``speed/`` in mixprec's cache folder).
        timer: runs one step and returns its seconds (default `wall_clock_timer`);
            tests pass a fake.
        should_stop: polled before each step (the CLI passes its Ctrl-C flag); when
            it returns True the measurement stops with `KeyboardInterrupt` and
            nothing is cached.
        progress: called after each step with (steps done, steps in all).

    Raises:
        ValueError: neither or both of model and shapes, a model without an example
            input, a model on another device than `device`, bad shapes, formats,
            counts (at most `MAX_STEPS_PER_FORMAT`) or cache mode.
    """
    _check_count("warmup", warmup, 0)
    _check_count("repeats", repeats, 1)
    mode = cache_mode(cache)
    if (model is None) == (shapes is None):
        raise ValueError("give a model (with example_input) or matmul shapes, not both or neither")
    matmuls: tuple[MatmulShape, ...] = ()
    if model is not None:
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"model must be a torch.nn.Module, got {type(model).__name__}: wrap the "
                "function in a Module, or time matmul shapes instead"
            )
        if example_input is None:
            raise ValueError("a model is timed on an example input: pass example_input")
        where = _device_of(model)
        if where.type == "meta":
            raise ValueError(
                "the model is on the meta device (it has no data to time): materialize it "
                "first (model.to_empty(device=...) and initialize its weights)"
            )
        asked = torch.device(device) if device is not None else where
        if asked.type != where.type or asked.index not in (None, where.index):
            raise ValueError(f"the model is on {where}, but device={str(asked)!r} was asked for")
        dev = where
        signature = model_signature(model, example_input, loss_fn)
        target = describe_model(model, example_input)
    else:
        assert shapes is not None
        if isinstance(shapes, str) or all(isinstance(s, str) for s in shapes):
            matmuls = parse_shapes(shapes)  # type: ignore[arg-type]
        elif all(isinstance(s, MatmulShape) for s in shapes) and shapes:
            matmuls = tuple(shapes)  # type: ignore[arg-type]
        else:
            raise TypeError(f"shapes must be 'MxNxK' strings or MatmulShapes, got {shapes!r}")
        dev = torch.device(
            device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
        )
        signature = f"matmuls:{format_shapes(matmuls)}"
        target = f"matmuls {format_shapes(matmuls)}"
    if label:
        target = f"{label}: {target}"
    caps = device_caps(dev)
    measured, skipped = _candidates(caps, formats)
    threads = torch.get_num_threads()
    key = {
        "device": dataclasses.asdict(caps),
        "torch": torch.__version__,
        "threads": threads,
        "target": signature,
        "formats": measured,
        "warmup": warmup,
        "repeats": repeats,
    }
    status: CacheStatus = mode if mode != "use" else "miss"
    samples = None
    if mode == "use":
        status, samples = read_entry(key, cache_dir)
    path = None
    if samples is None:
        if matmuls:
            model, example_input = matmul_model(matmuls, device=dev)
        assert model is not None
        fork = []
        if dev.type == "cuda":
            fork = [dev.index if dev.index is not None else torch.cuda.current_device()]
        with (
            torch.random.fork_rng(devices=fork),
            model_steps(
                model, example_input, formats=measured, device_type=dev.type, loss_fn=loss_fn
            ) as steps,
        ):
            samples = time_interleaved(
                steps,
                timer=timer or wall_clock_timer(dev),
                warmup=warmup,
                repeats=repeats,
                should_stop=should_stop,
                progress=progress,
            )
        if mode != "off":
            written = write_entry(key, samples, cache_dir)
            path = None if written is None else str(written)
            if written is None:
                status = "unwritable"
    else:
        path = str(entry_path(key, cache_dir))
    return SpeedMeasurement(
        device=str(dev),
        device_name=caps.name,
        target=target,
        threads=threads,
        torch_version=torch.__version__,
        warmup=warmup,
        repeats=repeats,
        samples=samples,
        skipped=skipped,
        cache=status,
        cache_path=path,
    )


def measure_for_auto(
    name: object,
    model: nn.Module | None,
    example_input: Any,
    device: torch.device | str | None,
) -> SpeedMeasurement:
    """The measurement a ``Precision("auto", model=..., example_input=...)`` decides from."""
    if not (isinstance(name, str) and name.strip().lower() == "auto"):
        raise ValueError(
            f"model= and example_input= are for Precision('auto', ...): they time the model "
            f"to choose a preset; policy {getattr(name, 'name', name)!r} is already chosen"
        )
    if model is None or example_input is None:
        missing = "model" if model is None else "example_input"
        raise ValueError(
            f"Precision('auto', ...) measures a model on an example input: pass {missing}="
        )
    return measure_speed(model, example_input, device=device)
