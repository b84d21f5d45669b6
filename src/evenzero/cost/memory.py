"""Gradient and optimizer memory per rank, by strategy, from a plan alone.

What is counted: gradients at rest after backward, communication buffers alive during
backward ("in flight"), and optimizer memory (fp32 master weights + Adam's two fp32
states). Model parameters, activations and allocator slack are not counted: they are the
same for every ZeRO-1/2 strategy and would hide the differences.

Assumptions, per strategy, are the `MemoryModel` of its `Strategy` record
(`evenzero.strategies.registry`):

* evenzero: an fp32 gradient shard of 1/N of each layout (padding included) at rest; two
  buckets in flight in the message dtype (one filling while the previous reduce-scatters).
* deepspeed-0.6 / deepspeed: the partition's gradients in the message dtype at rest
  (`averaged_gradients`), plus one IPG buffer of `reduce_bucket_size` elements, allocated
  at its full size whatever the model (`setup_buckets`,
  deepspeed/runtime/zero/stage_1_and_2.py@edaa72212:L2493-2516; overlap_comm off, the
  ZeRO-2 default; on, it is 2).
* megatron: the full, padded grad buffer stays allocated on every rank (the buffer is
  the reduce-scatter input, in the message dtype), so ZeRO-1 memory; nothing extra in
  flight because the reduce-scatter runs in place (`_ParamAndGradBuffer`,
  megatron/core/distributed/param_and_grad_buffer.py@d98e8a64).
* fsdp2: fp32 sharded gradients (padded per parameter, as the plan's layouts say) at rest;
  one unit's reduce-scatter input in flight (the next one waits on it;
  torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py `foreach_reduce`).
* ddp: full gradients in the message dtype (`gradient_as_bucket_view=True`, so the
  buckets are the gradients) and full optimizer state; a separate fp32 master copy only
  when the message dtype is narrower than fp32.
* a plan from an unregistered planner: its partition in the message dtype and one
  bucket in flight (`GENERIC_MEMORY`).

Every sharded strategy counts an fp32 master shard even for fp32 models, because the
flat fp32 shard the optimizer steps on is a copy of the module's parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

from evenzero.plan import BACKWARD, Plan
from evenzero.strategies.deepspeed import DEFAULT_REDUCE_BUCKET_SIZE
from evenzero.strategies.registry import GENERIC_MEMORY, STRATEGIES, GradsAtRest

FP32 = 4
ADAM_STATE_BYTES = 8
"""exp_avg and exp_avg_sq, fp32 each."""
MASTER_BYTES = 4
"""fp32 master copy of a parameter."""
DEEPSPEED_REDUCE_BUCKET = DEFAULT_REDUCE_BUCKET_SIZE
"""DeepSpeed's default `reduce_bucket_size`, in elements (the planner's constant)."""


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank for gradients and optimizer state under one plan."""

    grad_bytes: int
    """Gradients at rest after backward."""
    inflight_bytes: int
    """Communication buffers alive during backward, on top of `grad_bytes`."""
    optimizer_bytes: int
    """fp32 master weights and Adam's two states for the elements this rank updates."""
    basis: str
    """One line on what was assumed for this strategy."""

    @property
    def total_bytes(self) -> int:
        return self.grad_bytes + self.inflight_bytes + self.optimizer_bytes


def _grad_itemsize(plan: Plan) -> dict[str, int]:
    """Message dtype size per group, read off the backward collectives."""
    out: dict[str, int] = {}
    for c in plan.collectives:
        if c.phase == BACKWARD:
            out.setdefault(c.group, c.itemsize)
    return out


def estimate_memory(plan: Plan, bucket_numel: int | None = None) -> MemoryEstimate:
    """Memory per rank for `plan`, by its strategy's `MemoryModel`; `bucket_numel` is the
    user's bucket size, if given (a reserved buffer, DeepSpeed's IPG one, has that size)."""
    strategy = STRATEGIES.get(plan.strategy)
    model = strategy.memory if strategy is not None else GENERIC_MEMORY
    itemsize = _grad_itemsize(plan)
    size = {g.name: itemsize.get(g.name, FP32) for g in plan.groups}
    full = sum(g.numel for g in plan.groups)
    shard = sum(plan.shard_numel(g.name) for g in plan.groups)
    widest = max(size.values(), default=FP32)
    grads = {
        GradsAtRest.FP32_SHARD: shard * FP32,
        GradsAtRest.MESSAGE_SHARD: sum(plan.shard_numel(g.name) * size[g.name]
                                       for g in plan.groups),
        GradsAtRest.PADDED_BUFFER: sum(b.numel * size[b.group] for b in plan.layouts),
        GradsAtRest.FULL: sum(g.numel * size[g.name] for g in plan.groups),
    }[model.grads_at_rest]
    # A bucket may span groups (DeepSpeed's one IPG bucket): charge the widest dtype.
    largest_bucket = max((b.numel * size.get(b.group, widest) for b in plan.buckets), default=0)
    inflight = model.buckets_in_flight * largest_bucket
    reserved = None
    if model.reserved_buffer_numel is not None:
        reserved = bucket_numel or model.reserved_buffer_numel
        inflight += reserved * widest
    if plan.sharded:
        optimizer = shard * (MASTER_BYTES + ADAM_STATE_BYTES)
        state = "sharded master + Adam"
    else:
        masters = sum(g.numel * MASTER_BYTES for g in plan.groups if size[g.name] < FP32)
        optimizer = full * ADAM_STATE_BYTES + masters
        state = "full Adam state"
    parts = [model.grads_at_rest.value]
    if model.in_flight_basis:
        parts.append(model.in_flight_basis.format(reserved=reserved))
    basis = " + ".join(parts) + "; " + state
    if strategy is None:
        basis += f" (generic: no memory model for {plan.strategy!r})"
    return MemoryEstimate(grads, inflight, optimizer, basis)


__all__ = ["DEEPSPEED_REDUCE_BUCKET", "MemoryEstimate", "estimate_memory"]
