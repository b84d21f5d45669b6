"""Each rank's flat shards of a group: master weights and accumulated gradients.

A group's shard is the concatenation, over the group's layouts in index order, of this
rank's equal slice of each layout, padding included: exactly what
`plan.shard_ranges(group, rank)` describes with `shard_offset`. The optimizer steps
the master shard; the step writes it back into this rank's slice of each flat
parameter buffer and all-gathers the layout.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from evenzero.plan import STEP, Collective, Plan
from evenzero.runtime.buckets import FlatParams
from evenzero.runtime.collectives import all_gather_flat
from evenzero.spec import DTYPE_BYTES, dtype_name


@dataclass(eq=False)
class GroupState:
    """Runtime state of one parameter group on this rank."""

    name: str
    """Group name in the plan."""
    process_group: Any
    """Process group the group's gradients are reduced and its params gathered over."""
    size: int
    """Ranks in `process_group`."""
    rank: int
    """This rank's rank within `process_group`."""
    param_dtype: torch.dtype
    """Dtype of the model parameters (and the flat parameter buffers)."""
    reduce_dtype: torch.dtype
    """Dtype gradients travel in."""
    master: torch.Tensor
    """This rank's fp32 (master dtype) shard of the parameters; the optimizer's param."""
    grad: torch.Tensor
    """This rank's accumulated, averaged gradient shard, same shape as `master`."""
    options: Mapping[str, Any]
    """Optimizer keyword overrides for this group."""


def load_masters(plan: Plan, flat: FlatParams, state: GroupState) -> None:
    """Master shard := this rank's slices of the flat parameter buffers."""
    for shard in plan.layout_shards(state.name):
        state.master[shard.shard_offset:shard.shard_offset + shard.numel].copy_(
            flat.owned_slice(state.name, shard.layout))


def param_values(plan: Plan, shard: torch.Tensor, state: GroupState) -> dict[str, torch.Tensor]:
    """Every parameter of the group, whole and flat, gathered from the ranks' shards."""
    out: dict[str, torch.Tensor] = {}
    layouts = plan.group_layouts(state.name)
    for lay, part in zip(layouts, plan.layout_shards(state.name), strict=True):
        full = torch.empty(lay.numel, dtype=shard.dtype, device=shard.device)
        mine = shard[part.shard_offset:part.shard_offset + part.numel].contiguous()
        all_gather_flat(full, mine, state.process_group)
        for s in lay.params:
            out[s.name] = full[s.offset:s.offset + s.numel]
    return out


def reshard(shard: torch.Tensor, old: Plan, new: Plan, state: GroupState) -> torch.Tensor:
    """The same values, moved from this rank's shard under `old` to its shard under `new`."""
    values = param_values(old, shard, state)
    out = torch.zeros(new.shard_numel(state.name), dtype=shard.dtype, device=shard.device)
    for r in new.shard_ranges(state.name, state.rank):
        out[r.shard_offset:r.shard_offset + r.numel] = values[r.param][r.start:r.start + r.numel]
    return out


def gather_order(plan: Plan, groups: Mapping[str, GroupState]) -> tuple[Collective, ...]:
    """The plan's all-gathers if they are one whole gather per layout, else our own."""
    layouts = {(lay.group, lay.index): lay.numel for lay in plan.layouts}
    planned = tuple(c for c in plan.step() if c.op == "all_gather")
    if (sorted((c.group, c.buffer_index) for c in planned) == sorted(layouts)
            and all(c.offset == 0 and not c.segments and c.numel == layouts[(c.group, c.buffer_index)]
                    for c in planned)):
        return planned
    return tuple(Collective(STEP, "all_gather", lay.group, groups[lay.group].size, None, lay.index,
                            0, lay.numel,
                            itemsize=DTYPE_BYTES[dtype_name(groups[lay.group].param_dtype)])
                 for lay in plan.layouts)


def reshard_group(optimizer: torch.optim.Optimizer, old: Plan, new: Plan,
                  state: GroupState) -> None:
    """Move a group's master shard, and its optimizer state shaped like it, to a new plan."""
    old_numel = state.master.numel()
    opt_state = optimizer.state.get(state.master, {})
    for key, value in list(opt_state.items()):
        if torch.is_tensor(value) and value.dim() == 1 and value.numel() == old_numel:
            opt_state[key] = reshard(value, old, new, state)
    state.master.data = reshard(state.master.detach(), old, new, state)
    # Gradients already reduced in this step (a re-plan after an earlier backward that
    # measured nothing) move too rather than being dropped.
    state.grad = reshard(state.grad, old, new, state)
