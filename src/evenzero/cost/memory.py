"""Gradient and optimizer memory per rank, from a plan and the memory model its planner set.

What is counted: gradients at rest after backward, communication buffers alive during
backward ("in flight"), and optimizer memory (master weights + Adam's two states, in the
master dtype). Model parameters, activations and allocator slack are not counted: they
are the same for every ZeRO-1/2 strategy and would hide the differences.

The assumptions are the plan's `MemoryModel` (`Plan.memory`), which each planner sets
from what the system it models does (its module docstring has the sources):

* `GradsAtRest`: what gradient memory stays between backward and step;
* `buckets_in_flight`: buffers of the largest bucket alive during backward, in the
  message dtype; `reserved_buffer_numel`: a buffer allocated whatever the model
  (DeepSpeed's IPG buffer);
* `aliased_groups`: groups whose master is the parameters' own memory, so only the
  optimizer state is extra (evenzero's fp32 parameters with fp32 masters; DDP's fp32
  parameters, stepped in place).

A plan whose planner set no model (a custom callable) is estimated with
`GENERIC_MEMORY`: its partition in the message dtype and one bucket in flight.
"""

from __future__ import annotations

from dataclasses import dataclass

from evenzero.plan import BACKWARD, GradsAtRest, MemoryModel, Plan
from evenzero.spec import DTYPE_BYTES
from evenzero.wire import RESIDUAL_ITEMSIZE, scratch_bytes

FP32 = 4
ADAM_STATES = 2
"""exp_avg and exp_avg_sq per element, each in the master dtype."""

GENERIC_MEMORY = MemoryModel(GradsAtRest.MESSAGE_SHARD, buckets_in_flight=1,
                             in_flight_basis="one bucket in flight")
"""The memory model of a plan whose planner set none (`Plan.memory` is None)."""


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank for gradients and optimizer state under one plan."""

    grad_bytes: int
    """Gradients at rest after backward."""
    inflight_bytes: int
    """Communication buffers alive during backward, on top of `grad_bytes`."""
    optimizer_bytes: int
    """Master weights (where not the parameters' own memory) and Adam's two states for
    the elements this rank updates."""
    basis: str
    """One line on what was assumed for this strategy."""
    residual_bytes: int = 0
    """Error feedback's fp32 residual of every compressed bucket (`MemoryModel.residual_numel`)."""
    host_bytes: int = 0
    """`MemoryModel.offloaded`: what the rank holds in host memory instead (the gradient
    shard, masters, optimizer state and the copies' staging); not in `total_bytes`."""

    @property
    def total_bytes(self) -> int:
        return self.grad_bytes + self.inflight_bytes + self.optimizer_bytes + self.residual_bytes


def _grad_itemsize(plan: Plan) -> dict[str, int]:
    """Message dtype size per group, read off the backward collectives."""
    out: dict[str, int] = {}
    for c in plan.collectives:
        if c.phase == BACKWARD:
            out.setdefault(c.group, c.itemsize)
    return out


def estimate_memory(plan: Plan, bucket_numel: int | None = None) -> MemoryEstimate:
    """Memory per rank for `plan`, by its `MemoryModel`; `bucket_numel` overrides the size
    of a reserved buffer (DeepSpeed's IPG buffer has the user's bucket size)."""
    model = plan.memory or GENERIC_MEMORY
    itemsize = _grad_itemsize(plan)
    size = {g.name: itemsize.get(g.name, FP32) for g in plan.groups}
    shard = {g.name: plan.shard_numel(g.name) for g in plan.groups}
    widest = max(size.values(), default=FP32)
    master = model.master_itemsize
    grads = {
        GradsAtRest.MASTER_SHARD: lambda: sum(shard.values()) * master,
        GradsAtRest.MESSAGE_SHARD: lambda: sum(shard[g.name] * size[g.name] for g in plan.groups),
        GradsAtRest.PADDED_BUFFER: lambda: sum(b.numel * size[b.group] for b in plan.layouts),
        GradsAtRest.FULL: lambda: sum(g.numel * size[g.name] for g in plan.groups),
        GradsAtRest.BUFFERS_AND_SHARD: lambda: (
            sum(b.numel * DTYPE_BYTES[plan.group(b.group).dtype] for b in plan.buckets)
            + sum(shard.values()) * master),
    }[model.grads_at_rest]()
    # A bucket may span groups (DeepSpeed's one IPG bucket): charge the widest dtype.
    largest_bucket = max((b.numel * size.get(b.group, widest) for b in plan.buckets), default=0)
    inflight = model.buckets_in_flight * largest_bucket
    # A compressed bucket's encoded send and receive buffers (and int8's fp32 scratch)
    # come from its pool slot too, one per bucket in flight.
    codec = max((scratch_bytes(c.compression, c.numel, c.itemsize, c.block_numel or 1)
                 for c in plan.backward()), default=0)
    if codec:
        limit = plan.execution.max_in_flight
        inflight += codec * (len(plan.buckets) if limit is None else max(limit, 1))
    residual = model.residual_numel * RESIDUAL_ITEMSIZE
    reserved = None
    if model.reserved_buffer_numel is not None:
        reserved = bucket_numel or model.reserved_buffer_numel
        inflight += reserved * widest
    state = ADAM_STATES * master
    aliased = set(model.aliased_groups)
    if plan.sharded:
        optimizer = sum(n * (state + (0 if g in aliased else master)) for g, n in shard.items())
        # Muon keeps one momentum per matrix element where Adam keeps two moments.
        optimizer -= model.momentum_only_numel * master
        held = [g.name for g in plan.groups if g.name not in aliased]
        if not held:
            what = "sharded Adam, master = the owned slice of the parameters"
        elif len(held) < len(plan.groups):
            what = f"sharded master ({', '.join(held)}) + Adam"
        else:
            what = "sharded master + Adam"
    else:
        optimizer = sum(g.numel * (state + (0 if g.name in aliased else master))
                        for g in plan.groups)
        what = "full Adam state"
    host = 0
    if model.offloaded:
        # runtime/offload.py: the gradient shard, masters and state move to the host, with
        # staging of one shard in the parameter dtype (published parameters) and of one
        # bucket's share in the master dtype (landed gradients).
        shard_grads = sum(shard.values()) * master
        host = (shard_grads + optimizer
                + sum(shard[g.name] * DTYPE_BYTES[g.dtype] for g in plan.groups)
                + max((b.numel // max(1, plan.group(b.group).size) for b in plan.buckets),
                      default=0) * master)
        grads -= shard_grads
        optimizer = 0
        what += " in host memory (offload_optimizer)"
    label = model.grads_at_rest.value
    if master != FP32:
        label = label.replace("fp32", f"{master * 8}-bit")
    parts = [label]
    if model.in_flight_basis:
        parts.append(model.in_flight_basis.format(reserved=reserved))
    if codec:
        parts.append("compressed send/receive buffers")
    if residual:
        parts.append("fp32 error-feedback residual")
    basis = " + ".join(parts) + "; " + what
    if plan.memory is None:
        basis += f" (generic: planner of {plan.strategy!r} set no memory model)"
    return MemoryEstimate(grads, inflight, optimizer, basis, residual, host)


__all__ = ["GENERIC_MEMORY", "MemoryEstimate", "estimate_memory"]
