"""torch DistributedDataParallel, made expert-aware: no sharding, one all-reduce per bucket.

Bucketing follows `torch/nn/parallel/distributed.py` and the C++ Reducer
(`_compute_bucket_assignment_by_size`): params are appended to a bucket until its size in
bytes reaches the limit, then the bucket closes *after* that param. The first bucket's
limit is `dist._DEFAULT_FIRST_BUCKET_BYTES` (1 MiB) and later ones `bucket_cap_mb` (25
MiB), so the first gradients do not wait behind a large bucket. A user-set cap (here
`bucket_numel`, in elements) applies to every bucket, the first one included, as in torch.

Which order the params are bucketed in depends on whether every param gets a gradient:

* all do (`find_unused_parameters=False`, the default): after the first iteration the
  Reducer rebuilds its buckets in the order gradients became ready, i.e. arrival order;
  this is the steady state planned here.
* some do not: DDP then needs `find_unused_parameters=True`, which disables the rebuild.
  Buckets are cut over registration order and the bucket list reversed (the last
  registered params reduce first); the unused params are marked ready at the first hook
  and all-reduced as zeros with their bucket.

Either way the Reducer launches buckets strictly in index order. Expert params (the
"expert-aware" part) get their own buckets, all-reduced over their expert-DP group, so
`Plan.buckets` mixes the groups in launch order. DDP keeps full optimizer state on every
rank, so the plan is unsharded and has no ownership layouts and no step collectives.
"""

from __future__ import annotations

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
)
from evenzero.spec import DTYPE_BYTES, ModelSpec
from evenzero.strategies.common import (
    PlanOptions,
    check_has_params,
    group_dtype,
    group_infos,
    message_itemsize,
    per_param,
    step_work,
)

FIRST_BUCKET_BYTES = 1024 * 1024
"""`dist._DEFAULT_FIRST_BUCKET_BYTES`."""
BUCKET_BYTES = 25 * 1024 * 1024
"""Default `bucket_cap_mb` = 25, in bytes."""


def bucket_limits(itemsize: int, options: PlanOptions) -> tuple[int, int]:
    """(first bucket, later buckets) limits in bytes."""
    if options.fixed_bucket_numel:
        cap = options.fixed_bucket_numel * itemsize
        return cap, cap
    return FIRST_BUCKET_BYTES, BUCKET_BYTES


def assign_buckets(names: list[str], numel: dict[str, int], itemsize: int,
                   limits: tuple[int, int]) -> list[list[str]]:
    """The Reducer's greedy cut: close a bucket once it reaches its byte limit."""
    out: list[list[str]] = []
    current: list[str] = []
    size = 0
    for n in names:
        current.append(n)
        size += numel[n] * itemsize
        if size >= limits[min(len(out), 1)]:
            out.append(current)
            current, size = [], 0
    if current:
        out.append(current)
    return out


def group_buckets(spec: ModelSpec, info: GroupInfo, options: PlanOptions) -> tuple[list[Bucket], bool]:
    """The group's buckets in launch order, and whether some param goes unused."""
    params = spec.group_params(info.name)
    numel = {p.name: p.numel for p in params}
    itemsize = DTYPE_BYTES[group_dtype(spec, info.name)]
    limits = bucket_limits(itemsize, options)
    arrived = [n for n in spec.arrival_order if n in numel]
    unused = len(arrived) < len(params)
    if unused:
        cut = list(reversed(assign_buckets([p.name for p in params], numel, itemsize, limits)))
    else:
        cut = assign_buckets(arrived, numel, itemsize, limits)
    buckets = []
    for i, names in enumerate(cut):
        slots, offset = [], 0
        for n in names:
            slots.append(Slot(n, offset, numel[n]))
            offset += numel[n]
        buckets.append(Bucket(info.name, i, offset, tuple(slots)))
    return buckets, unused


def launch_order(spec: ModelSpec, infos: tuple[GroupInfo, ...],
                 per_group: list[list[Bucket]]) -> list[Bucket]:
    """Buckets across groups by launch time: bucket k of a group goes once it and every
    earlier bucket of that group are ready. Unused params count as ready at the start."""
    position = {n: i for i, n in enumerate(spec.arrival_order)}
    timed = []
    for group_rank, buckets in enumerate(per_group):
        launch = -1
        for b in buckets:
            launch = max(launch, max((position.get(s.name, -1) for s in b.params), default=-1))
            timed.append((launch, group_rank, b.index, b))
    return [b for *_, b in sorted(timed, key=lambda t: t[:3])]


def plan_ddp(spec: ModelSpec, world_size: int, options: PlanOptions | None = None) -> Plan:
    options = options or PlanOptions()
    check_has_params(spec)
    infos = group_infos(spec, world_size)
    per_group, notes = [], []
    for info in infos:
        buckets, unused = group_buckets(spec, info, options)
        per_group.append(buckets)
        if unused:
            notes.append(f"group {info.name}: some params produce no gradient, so DDP needs "
                         f"find_unused_parameters=True: buckets follow reverse registration "
                         f"order and reduce the unused params as zeros")
    if options.round_robin:
        notes.append("round_robin applies to DeepSpeed only; ignored")
    ordered = launch_order(spec, infos, per_group)
    size = {g.name: g.size for g in infos}
    backward = [Collective(BACKWARD, "all_reduce", b.group, size[b.group], None, b.index, 0,
                           b.numel, itemsize=message_itemsize(spec, b.group, options))
                for b in ordered]
    fp32 = tuple(g.name for g in infos if g.dtype == "float32")
    plan = Plan("ddp", world_size, infos, tuple(ordered), (), tuple(backward),
                spec.arrival_order, tuple(notes), sharded=False, execution=EXECUTION,
                memory=MemoryModel(GradsAtRest.FULL, aliased_groups=fp32))
    # The user's optimizer over every parameter, torch's default implementation, no norm;
    # 16-bit parameters get their update from an fp32 master (mixed precision).
    return replace(plan, step_work=step_work(plan, spec, options, tensors=per_param(spec),
                                             copied=lambda g: g.name not in fp32))


EXECUTION = Execution(max_in_flight=None, launch_in_order=True, copies_grads=True,
                      missing_grads_hold_bucket=False)
"""The Reducer launches buckets in index order, asynchronously and without limit; with
the default `gradient_as_bucket_view=False` it copies each gradient into its bucket;
unused params count as ready. Memory: every gradient in the message dtype
(`gradient_as_bucket_view=True`, so the buckets are the gradients) and the full optimizer
state; fp32 parameters are stepped in place, 16-bit ones through an fp32 master."""
