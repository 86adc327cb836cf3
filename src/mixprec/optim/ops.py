"""``torch.ops.mixprec.step_``: the step of one batch of parameters as a PyTorch operator.

mixprec's optimizers step each family of parameters of a group through this
operator, so the profiler shows one ``mixprec::step_`` per call and
``torch.compile`` / ``torch._dynamo`` trace it as one opaque, in-place node
(no graph break; the implementation runs when the graph runs). It takes the
parameters, their state and their float64 step counters as lists, and the
group's hyperparameters as floats (their meaning is the rule's,
`mixprec.optim.rules`); its implementation is `StepKernel.run`
of `mixprec.optim.step_batch` (the native CPU kernel in one call, else the
portable path).

The schema declares what it writes: parameters, master and moment state and
the step counters. A fake implementation (nothing to compute: no outputs)
lets tracing run on fake tensors.

`step_` goes through the dispatcher whenever anyone could be watching:
under ``torch.compile`` / ``torch._dynamo`` tracing, with the profiler on, or
inside a ``TorchDispatchMode`` (fake tensors, ``make_fx``, debug modes). In
plain eager execution it calls the same implementation directly: the
dispatcher's round trip for a Python operator with list arguments costs about
15 us a call, which is a tenth of a small model's optimizer step.
"""

from __future__ import annotations

import torch

from mixprec.optim.kernels import KERNEL_MODES
from mixprec.optim.rules import Hyper
from mixprec.optim.step_batch import StepBatch, kernel_for

__all__ = ["OP_NAME", "observed", "step_"]

#: The operator's qualified name.
OP_NAME = "mixprec::step_"

# The schema lists the step's arguments one by one (a `StepBatch` and its hyper-
# parameters): torch.compile traces an operator through its schema, which knows
# tensor lists and scalars, not Python objects. `_from_schema` and `_schema_args`
# convert between the two; everywhere else a step call is one `StepBatch`.
torch.library.define(
    OP_NAME,
    "(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] master_state, "
    "Tensor(c!)[] moment_state, Tensor(d!)[] steps, Tensor[] seeds, int[] offsets, "
    "float h0, float h1, float h2, float h3, float h4, "
    "str rule, str master, str moments, bool maximize, int block_size, str kernel_mode) -> ()",
)


def _from_schema(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    master_state: list[torch.Tensor],
    moment_state: list[torch.Tensor],
    steps: list[torch.Tensor],
    seeds: list[torch.Tensor],
    offsets: list[int],
    h0: float,
    h1: float,
    h2: float,
    h3: float,
    h4: float,
    rule: str,
    master: str,
    moments: str,
    maximize: bool,
    block_size: int,
    kernel_mode: str,
) -> None:
    """The operator's implementation: its arguments as a batch, stepped."""
    # (``kernel_mode``, not ``mode``: torch's mode redirection takes a ``mode`` argument.)
    if kernel_mode not in KERNEL_MODES:
        raise ValueError(f"kernel_mode {kernel_mode!r} is not one of {', '.join(KERNEL_MODES)}")
    if len(grads) != len(params):
        raise ValueError(f"{len(params)} params need as many grads, got {len(grads)}")
    kernel = kernel_for(
        rule, master, moments, maximize=maximize, block_size=block_size, mode=kernel_mode
    )
    batch = StepBatch(
        kernel,
        block_size,
        params=params,
        grads=grads,
        master_state=master_state,
        moment_state=moment_state,
        steps=steps,
        seeds=seeds,
        offsets=list(offsets),
    )
    _step_impl(batch, (h0, h1, h2, h3, h4))


def _schema_args(batch: StepBatch, hyper: Hyper) -> tuple[object, ...]:
    """`batch` and `hyper` as the operator's arguments."""
    family = batch.family
    return (
        batch.params,
        batch.grads,
        batch.master_state,
        batch.moment_state,
        batch.steps,
        batch.seeds,
        batch.offsets,
        *hyper,
        family.rule.name,
        family.master.spec.name,
        family.moments.spec.name,
        family.maximize,
        batch.block_size,
        batch.kernel.requested,
    )


def _step_impl(batch: StepBatch, hyper: Hyper) -> None:
    batch.kernel.run(batch, hyper)
    # The native kernel writes through pointers: tell autograd the parameters changed
    # (the portable path's in-place copies count themselves; one more bump is harmless).
    if batch.kernel.is_native:
        torch.autograd.graph.increment_version(batch.params)


def _step_fake(*args: object, **kwargs: object) -> None:
    return None


torch.library.impl(OP_NAME, "default", _from_schema)
torch.library.register_fake(OP_NAME, _step_fake)


def step_(batch: StepBatch, hyper: Hyper) -> None:
    """Step `batch` through ``torch.ops.mixprec.step_`` (see the module's docstring).
    Parameters whose column statistics are reduced across ranks (`StepBatch.column_groups`:
    int4 moments under FSDP2) step outside the operator, and not inside torch.compile."""
    if any(batch.column_groups):
        if torch.compiler.is_compiling():
            raise RuntimeError(
                "int4 moments of FSDP2-sharded parameters reduce their column statistics "
                "across ranks, which the compiled optimizer step cannot: call "
                "optimizer.step() outside torch.compile"
            )
        _step_impl(batch, hyper)
    elif observed():
        torch.ops.mixprec.step_(*_schema_args(batch, hyper))
    else:
        _step_impl(batch, hyper)


def observed() -> bool:
    """Whether tracing, the profiler or a dispatch mode could see this call."""
    return (
        torch.compiler.is_compiling()
        or torch.autograd.profiler._is_profiler_enabled
        or torch._C._len_torch_dispatch_stack() > 0
    )
