"""Temporary instrumentation for the runtime probes: clip-call watching, non-finite hunting.

Both are installed only while needed and removed after: `ClipWatch` wraps
``torch.nn.utils.clip_grad_norm_``/``clip_grad_value_`` (restoring the originals
on `uninstall`); `NonfiniteHunter` adds forward hooks to every module while it
looks for the first module whose output turned inf/NaN, then removes them.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

__all__ = ["CLIP_FUNCTIONS", "ClipCall", "ClipWatch", "NonfiniteHit", "NonfiniteHunter"]

#: The gradient-clipping functions watched, by name.
CLIP_FUNCTIONS: tuple[str, ...] = ("clip_grad_norm_", "clip_grad_value_")


@dataclass(frozen=True, kw_only=True)
class ClipCall:
    """A call to a clipping function, as seen by `ClipWatch`.

    Attributes:
        function: ``"torch.nn.utils.clip_grad_norm_"`` or ``...clip_grad_value_``.
        caller: ``"file.py:42"`` of the code that called it.
        limit: the ``max_norm``/``clip_value`` it was called with, if a number.
    """

    function: str
    caller: str
    limit: float | None = None


class ClipWatch:
    """Wraps torch's clipping functions and reports each call to `on_call`.

    Args:
        on_call: called with a `ClipCall` before the real function runs.
    """

    def __init__(self, on_call: Callable[[ClipCall], None]) -> None:
        self._on_call = on_call
        self._active = False
        self._saved: list[tuple[Any, str, Any, Any]] = []

    @property
    def installed(self) -> bool:
        """Whether the wrappers are in place."""
        return self._active

    def install(self) -> None:
        """Wrap the clipping functions (idempotent)."""
        if self._active:
            return
        import torch.nn.utils as utils
        import torch.nn.utils.clip_grad as clip_grad

        self._active = True
        for name in CLIP_FUNCTIONS:
            original = getattr(utils, name)
            wrapper = self._wrap(original, f"torch.nn.utils.{name}")
            for module in (utils, clip_grad):
                if getattr(module, name, None) is original:
                    setattr(module, name, wrapper)
                    self._saved.append((module, name, original, wrapper))

    def _wrap(self, original: Callable[..., Any], label: str) -> Callable[..., Any]:
        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if self._active:
                frame = sys._getframe(1)
                raw = args[1] if len(args) > 1 else kwargs.get("max_norm", kwargs.get("clip_value"))
                limit = float(raw) if isinstance(raw, int | float) else None
                caller = f"{frame.f_code.co_filename}:{frame.f_lineno}"
                self._on_call(ClipCall(function=label, caller=caller, limit=limit))
            return original(*args, **kwargs)

        return wrapper

    def uninstall(self) -> None:
        """Restore the originals. A wrapper that someone wrapped again stays in place as a
        pass-through (it no longer reports)."""
        self._active = False
        for module, name, original, wrapper in reversed(self._saved):
            if getattr(module, name, None) is wrapper:
                setattr(module, name, original)
        self._saved.clear()


@dataclass(frozen=True, kw_only=True)
class NonfiniteHit:
    """The first module whose forward output held inf/NaN.

    Attributes:
        module: its qualified name in the model (``"<model>"`` for the root).
        module_type: its class name.
        inputs_finite: whether its floating inputs were all finite (True: it made
            the inf/NaN itself; False: they came in from upstream or the data).
        nonfinite_elements: inf/NaN elements in its output.
        has_nan: whether any of them is NaN (else all are inf).
        output_dtype: dtype of the first non-finite output tensor.
    """

    module: str
    module_type: str
    inputs_finite: bool
    nonfinite_elements: int
    has_nan: bool
    output_dtype: str


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() else []
    if isinstance(value, list | tuple):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


class NonfiniteHunter:
    """Forward hooks on every module of `model` that note the first non-finite output.

    Hooks fire when a module's forward returns, so children report before their
    parents: the first hit is the innermost, earliest module that produced it.
    """

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self.hit: NonfiniteHit | None = None

    @property
    def installed(self) -> bool:
        """Whether hooks are in place."""
        return bool(self._handles)

    def install(self) -> None:
        """Add the hooks (idempotent)."""
        if self._handles:
            return
        for name, module in self._model.named_modules():
            hook = functools.partial(self._hook, name or "<model>")
            self._handles.append(module.register_forward_hook(hook))

    def _hook(self, name: str, module: nn.Module, args: Any, output: Any) -> None:
        if self.hit is not None:
            return
        outputs = _tensors(output)
        # A fake-tensor forward (memory.estimate, torch.compile tracing) has no values
        # to test: reading them would raise a data-dependent error.
        if any(is_fake(t) for t in outputs):
            return
        with torch.no_grad():
            for out in outputs:
                bad = ~torch.isfinite(out)
                count = int(bad.sum())
                if count == 0:
                    continue
                inputs_finite = all(bool(torch.isfinite(t).all()) for t in _tensors(args))
                self.hit = NonfiniteHit(
                    module=name,
                    module_type=type(module).__name__,
                    inputs_finite=inputs_finite,
                    nonfinite_elements=count,
                    has_nan=bool(torch.isnan(out).any()),
                    output_dtype=str(out.dtype).removeprefix("torch."),
                )
                return

    def remove(self) -> None:
        """Remove every hook."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
