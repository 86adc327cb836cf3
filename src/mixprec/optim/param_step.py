"""One parameter stepped alone, bitwise as `RuleOptimizer.step` steps it.

Gradient release (`mixprec.engine.release`) steps each parameter from its
post-accumulate-grad hook while the backward still runs, so a step of the whole
optimizer per parameter (which checks every parameter of every group: O(N) a
call, O(N^2) a backward) is not an option. `ParamSteps` keeps, per parameter, a
gathered step of that parameter alone (`group_step.gather_group` over a group of
one, with its own native table), made at its first call and kept while its
group's gathered step is the one it was made beside; each call is then O(1).

Bitwise: every kernel path is elementwise (block-local for blockwise moments, and
a parameter's blocks never straddle another's), and the step counter,
hyperparameters and rounding key are the parameter's own, so a batch of one gives
the bits its row of the batched step gives. The group's gathered step stays the
record of the one edit rule (`resync`): a call first resets `p`'s master if `p`
was written in place since the optimizer last wrote it, then records its own write
there, so a later `step`, `state_dict` or `master_weights` sees no edit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from mixprec.optim.group_step import GroupStep, gather_group
from mixprec.optim.resync import follow_edits

if TYPE_CHECKING:
    from mixprec.optim.rule_optimizer import RuleOptimizer

__all__ = ["ParamSteps"]


@dataclass
class _Single:
    """A parameter's step of its own, and where it sits in its group's."""

    parent: GroupStep  # the group's gathered step when this was made
    index: int  # the group's index
    pos: int  # the parameter's position in the group
    alone: GroupStep  # the parameter alone: one batch of one row


class ParamSteps:
    """Each parameter's step of its own, for `RuleOptimizer.step_param`."""

    def __init__(self) -> None:
        self._singles: dict[int, _Single] = {}  # by id(p): each entry holds p (no reuse)
        self._where: dict[int, tuple[int, int]] = {}  # id(p) -> (group index, position)

    def clear(self) -> None:
        """Forget every step (a boundary: state loaded, groups gathered again), so no
        native table keeps replaced state tensors alive."""
        self._singles.clear()
        self._where.clear()

    def step(self, opt: RuleOptimizer, p: torch.Tensor, observed: bool) -> None:
        """Step `p` with its gradient (see the module); `observed` as `GroupStep.run`."""
        single = self._singles.get(id(p))
        if single is not None and not single.alone.current(single.alone.group):
            if single.alone.pointers not in (None, [p.data_ptr()]):  # storage replaced since
                single.parent.versions[single.pos] = -1
            single = None
        if (
            single is None
            or single.index >= len(opt._steps)
            or opt._steps[single.index] is not single.parent
        ):
            single = self._make(opt, p)
        parent, pos, alone = single.parent, single.pos, single.alone
        alone.versions = [parent.versions[pos]]
        if parent.version_of(p) != parent.versions[pos]:
            follow_edits(alone)  # written in place since the optimizer's last write
        alone.run(alone.rule.read(parent.group), observed)
        parent.versions[pos] = parent.version_of(p)

    def _make(self, opt: RuleOptimizer, p: torch.Tensor) -> _Single:
        """`p`'s step of its own, its state made now if it has none (as `step` makes it
        at a parameter's first gradient)."""
        where = self._where.get(id(p))
        groups = opt.param_groups
        if where is None or not (
            where[0] < len(groups)
            and where[1] < len(groups[where[0]]["params"])
            and groups[where[0]]["params"][where[1]] is p
        ):
            # O(N) once per boundary: every parameter's place, not just this one's.
            self._where = {
                id(q): (i, k) for i, g in enumerate(groups) for k, q in enumerate(g["params"])
            }
            where = self._where.get(id(p))
            if where is None:
                raise KeyError(f"parameter {tuple(p.shape)} is not in this optimizer")
        index, pos = where
        group = groups[index]
        parent = opt._steps[index] if index < len(opt._steps) else None
        if parent is None or pos >= len(parent.params) or parent.params[pos] is not p:
            parent = opt._gather(index, at_step=False)  # the group changed since (O(N), rare)
        fresh = not opt.state.get(p)
        alone = gather_group(
            {"params": [p], "maximize": group["maximize"]},
            index,
            rule=opt.rule_of(group),
            plans=opt._plans,
            state=opt.state,
            make_state=opt._state_of,
            block_size=opt._block_size,
            versions={id(p): parent.versions[pos]},
        )
        if fresh and opt.state.get(p):
            # State made here: the group's step lists `p` as pending, so it is gathered
            # again at its next use (`step`, `sync_edited`), keeping its version counters.
            parent.pointers = None
        single = self._singles[id(p)] = _Single(parent, index, pos, alone)
        return single
