"""The model the user holds is the truth: writes to parameters between steps are kept.

Users write to weights between steps: `model.load_state_dict(pretrained)`, `p.copy_(...)`,
in-place ops, `p.data.clamp_(-c, c)` (WGAN), `p.data = tensor`. Each rank's master shard
would otherwise overwrite them at the next step, silently. Version counters cannot see
them all (`p.data.clamp_()` bypasses them, and a parameter re-pointed with
`p.data = view` does not share the flat buffer's counter), so values are compared
instead, once per step, before the inner step:

1. `adopt_replaced`: a parameter whose `.data` was replaced (it no longer points into
   its flat buffer) has its new values copied into the buffer, then is re-pointed;
2. `refresh_masters`: each rank reads its owned slice of every flat buffer back into its
   master shard. For fp32 parameters that is a plain copy. For bf16/fp16 parameters the
   master keeps its extra precision wherever the parameter still equals the master
   rounded to the parameter dtype, and takes the parameter's value where it differs.

Every rank refreshes only its own slice, so a write must be made on every rank (as the
same code on every rank does); a write on one rank only changes that rank's slice.
"""

from __future__ import annotations

import torch

from evenzero.plan import Plan
from evenzero.runtime.buckets import FlatParams
from evenzero.runtime.checks import ZeroRuntimeError


def adopt_replaced(flat: FlatParams) -> list[str]:
    """Copy the values of parameters whose `.data` was replaced into their flat buffer
    and point them back at it; returns their names."""
    if flat.in_place():
        return []
    moved = []
    with torch.no_grad():
        for lay in flat.plan.layouts:
            buf = flat.buffers[(lay.group, lay.index)]
            for s in lay.params:
                p = flat.params[s.name]
                view = buf[s.offset:s.offset + s.numel]
                if p.data_ptr() == view.data_ptr() and p.dtype == buf.dtype and p.is_contiguous():
                    continue
                if p.device != buf.device or p.numel() != s.numel:
                    raise ZeroRuntimeError(
                        f"parameter {s.name!r} was moved to {p.device} or resized to "
                        f"{list(p.shape)} after ZeroOptimizer was built; move or resize the "
                        f"model before building it")
                view.copy_(p.detach().reshape(-1))
                p.data = view.view(p.shape)
                moved.append(s.name)
    return moved


def pick_up(master: torch.Tensor, owned: torch.Tensor) -> None:
    """Master slice := the parameter values in `owned`, keeping the master's precision
    where the parameter was not written (it still equals the rounded master)."""
    if owned.dtype == master.dtype:
        master.copy_(owned)
        return
    written = owned != master.to(owned.dtype)
    master.copy_(torch.where(written, owned.to(master.dtype), master))


def refresh_masters(plan: Plan, flat: FlatParams, group: str, master: torch.Tensor) -> None:
    """Pick up every write to the parameters of `group` in this rank's master shard."""
    with torch.no_grad():
        for shard in plan.layout_shards(group):
            pick_up(master[shard.shard_offset:shard.shard_offset + shard.numel],
                    flat.owned_slice(group, shard.layout))
