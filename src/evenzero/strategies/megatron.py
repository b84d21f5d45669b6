"""Megatron-core DDP with the distributed optimizer.

Source: NVIDIA/Megatron-LM at commit d98e8a64, megatron/core/distributed/
param_and_grad_buffer.py (`_ParamAndGradBuffer`, `_ParamAndGradBucketGroup.start_grad_sync`),
megatron/core/optimizer/distrib_optimizer.py (`_build_model_gbuf_range`) and
megatron/core/distributed/distributed_data_parallel.py (the bucket size).

Per buffer (one per param group here: dense, and experts on their expert-DP group):

* params are laid out in reverse registration order (`params[::-1]`, Megatron's
  approximation of backward order), each param start rounded up to 64 elements;
* a bucket closes *after* the param that makes `param_end - bucket_start >= bucket_size`,
  so a param never straddles buckets;
* the bucket end is padded to `lcm(W, 128)` so every rank's chunk is equal and aligned;
* rank r owns the r-th contiguous slice of every bucket, cutting through params.

Each bucket is one `reduce_scatter_tensor`, launched once every param in it has its
gradient; the step all-gathers each bucket's params back. Unlike evenzero, Megatron keeps
the whole gradient buffer allocated on every rank (ZeRO-1 gradient memory).
"""

from __future__ import annotations

import math
from dataclasses import replace

from evenzero.plan import (
    BACKWARD,
    Bucket,
    Collective,
    Execution,
    GradsAtRest,
    GroupInfo,
    MemoryModel,
    Plan,
    Slot,
    align_up,
)
from evenzero.spec import ModelSpec
from evenzero.strategies.common import (
    PlanOptions,
    all_gathers,
    check_has_params,
    completion_order,
    group_infos,
    message_itemsize,
    per_param,
    step_work,
)

PARAM_START_ALIGNMENT = 64
"""`_pad_start_of_param_if_needed`: elements each param start is rounded up to."""
BUCKET_END_ALIGNMENT = 128
"""`bucket_end_divisor`: a bucket ends on a multiple of lcm(W, this)."""


def default_bucket_numel(group_size: int) -> int:
    """`DistributedDataParallel.__init__`: larger DP needs larger buckets to stay
    bandwidth-bound."""
    return max(40_000_000, 1_000_000 * group_size)


def bucket_end_divisor(group_size: int) -> int:
    return math.lcm(group_size, BUCKET_END_ALIGNMENT)


def group_buffer(spec: ModelSpec, info: GroupInfo, bucket_numel: int) -> list[Bucket]:
    """The group's grad buffer cut into buckets; Slot offsets are bucket-relative."""
    divisor = bucket_end_divisor(info.size)
    buckets: list[Bucket] = []
    slots: list[Slot] = []
    bucket_start = param_start = param_end = 0
    for p in reversed(spec.group_params(info.name)):
        param_start = align_up(param_start, PARAM_START_ALIGNMENT)
        param_end = param_start + p.numel
        slots.append(Slot(p.name, param_start - bucket_start, p.numel))
        param_start = param_end
        if param_end - bucket_start >= bucket_numel:
            bucket_end = align_up(param_end, divisor)
            buckets.append(Bucket(info.name, len(buckets), bucket_end - bucket_start, tuple(slots)))
            bucket_start = param_start = bucket_end
            slots = []
    if slots:
        bucket_end = align_up(param_end, divisor)
        buckets.append(Bucket(info.name, len(buckets), bucket_end - bucket_start, tuple(slots)))
    return buckets


def plan_megatron(spec: ModelSpec, world_size: int, options: PlanOptions | None = None) -> Plan:
    options = options or PlanOptions()
    check_has_params(spec)
    infos = group_infos(spec, world_size)
    buckets: list[Bucket] = []
    notes = ["gradient buffer stays full-size on every rank (ZeRO-1 gradient memory); "
             "only optimizer state is sharded"]
    for info in infos:
        limit = options.fixed_bucket_numel or default_bucket_numel(info.size)
        buckets += group_buffer(spec, info, limit)
    arrived = set(spec.arrival_order)
    missing = [p.name for p in spec.params if p.name not in arrived]
    if missing:
        notes.append(f"{len(missing)} param(s) produce no gradient; their buckets are "
                     f"reduced by finish_grad_sync after backward, not overlapped")
    if options.round_robin:
        notes.append("round_robin applies to DeepSpeed only; ignored")
    size = {g.name: g.size for g in infos}
    ordered = completion_order(spec, buckets)
    backward = [Collective(BACKWARD, "reduce_scatter", b.group, size[b.group], None, b.index, 0,
                           b.numel, itemsize=message_itemsize(spec, b.group, options))
                for b in ordered]
    # start_param_sync walks the bucket groups in buffer order, dense before expert.
    step = all_gathers(spec, infos, buckets)
    plan = Plan("megatron", world_size, infos, tuple(ordered), tuple(buckets),
                tuple(backward + step), spec.arrival_order, tuple(notes), execution=EXECUTION,
                memory=MEMORY)
    # The fp32 multi-tensor L2 norm (megatron/core/optimizer/clip_grads.py L106-121) and
    # the fused Adam of Transformer Engine or Apex; only 16-bit parameters have a master
    # to copy back (distrib_optimizer.py L445; for fp32 the shard is a view, L465-491).
    return replace(plan, step_work=step_work(
        plan, spec, options, norm="fp32", optimizer_impl="fused", tensors=per_param(spec),
        copied=lambda g: g.dtype != "float32"))


EXECUTION = Execution(max_in_flight=None, launch_in_order=False, copies_grads=False)
"""`register_grad_ready` starts a bucket's reduce-scatter as soon as it is complete, async
on the communicator's stream; gradients accumulate into the bucket's buffer in place."""

MEMORY = MemoryModel(GradsAtRest.PADDED_BUFFER)
"""The full, padded grad buffer stays allocated on every rank (it is the reduce-scatter
input, in the message dtype), so ZeRO-1 gradient memory; nothing extra in flight: the
reduce-scatter runs in place (`_ParamAndGradBuffer`)."""
