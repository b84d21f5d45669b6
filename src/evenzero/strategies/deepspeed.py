"""DeepSpeed ZeRO-2's backward schedule, old and new.

Source: deepspeed/runtime/zero/stage_1_and_2.py (`average_tensor`) at commit edaa72212
(after v0.19.5; unversioned line numbers below are there), v0.9.0 and v0.6.1. All three
variants share the layout, the IPG buckets and `rank_and_offsets` of `deepspeed_layout`;
they differ only in how a flushed bucket is communicated (@edaa72212:L1438-1468; before
v0.12.4, v0.6.1:L958-973 and v0.9.0:L972-987):

* "deepspeed-0.6" (v0.10 .. v0.12.3; v0.6-v0.9 differ only in not checking the process
  group when merging): one `reduce` per `rank_and_offsets` entry, rooted at the entry's
  owner. The seed case's 13 uneven reduces.
* "deepspeed" (v0.12.4+, `use_multi_rank_bucket_allreduce=True`, the default): entries
  grouped by process group; each group's slices flattened into one `all_reduce`,
  chunked by `reduce_bucket_size`.
* "deepspeed-reduce-mode" (`use_multi_rank_bucket_allreduce=False`): one `reduce` per
  distinct (destination, process group), its runs concatenated, likewise chunked.

The step is planned the same for all: three 1-element norm all-reduces over the world,
then one `all_gather_into_tensor` of each group's flat layout on its (expert-)DP group.
That is exact from 0.12.4 (deepspeedai/DeepSpeed#4695, `all_gather_dp_groups`,
deepspeed/runtime/utils.py@edaa72212:1005-1013); before it, "deepspeed-0.6" gathered in chunks of
`allgather_bucket_size` (5e8 elements), which is one call per group for every preset
here except the very largest, so the simplification only undercounts those.

Params whose gradient never arrives produce no collective at all: the owner steps on
zeros with no cross-rank agreement (`independent_gradient_partition_epilogue`,
L919-969; zeros for a None grad at L2110-2111). The plan says so in its notes.

`Plan.buckets` are the IPG buckets themselves (group `IPG_GROUP`, since one bucket mixes
dense and expert params); `evenzero.strategies.executable.split_by_group` re-expresses a
plan with single-group buckets for the runtime, with the same collectives.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from evenzero.plan import BACKWARD, STEP, Collective, Execution, GradsAtRest, MemoryModel, Plan
from evenzero.spec import ModelSpec
from evenzero.strategies.common import (
    MAX_WORLD_SIZE,
    PlanOptions,
    all_gathers,
    check_has_params,
    check_world_size,
    group_infos,
    message_itemsize,
    step_work,
)
from evenzero.strategies.deepspeed_layout import (
    ReduceEntry,
    ZeroPartitioning,
    partition_zero,
)

DEFAULT_REDUCE_BUCKET_SIZE = 500_000_000
"""`reduce_bucket_size` default, in elements (deepspeed/runtime/zero/config.py@edaa72212:L113)."""

NORM_ALL_REDUCES = 3
"""1-element all-reduces DeepSpeed's step issues over the world (grad norm and overflow)."""

Dispatch = Callable[[ModelSpec, ZeroPartitioning, int, PlanOptions], list[Collective]]


def chunk_entries(entries: list[ReduceEntry], limit: int) -> list[list[ReduceEntry]]:
    """`allreduce_and_scatter` / `allreduce_no_retain` chunking: append, then close the
    chunk once its running numel exceeds `limit` (so a chunk can overrun by one slice)."""
    chunks: list[list[ReduceEntry]] = []
    current: list[ReduceEntry] = []
    running = 0
    for e in entries:
        current.append(e)
        running += e.numel
        if running > limit:
            chunks.append(current)
            current, running = [], 0
    if current:
        chunks.append(current)
    return chunks


def coalesce(entries: list[ReduceEntry]) -> tuple[tuple[int, int], ...]:
    """The bucket pieces a flattened message reads, adjacent runs joined."""
    pieces: list[tuple[int, int]] = []
    for e in entries:
        if pieces and pieces[-1][0] + pieces[-1][1] == e.offset:
            pieces[-1] = (pieces[-1][0], pieces[-1][1] + e.numel)
        else:
            pieces.append((e.offset, e.numel))
    return tuple(pieces)


def flattened(op: str, spec: ModelSpec, options: PlanOptions, bucket: int,
              chunk: list[ReduceEntry], root: int | None) -> Collective:
    """One collective over a flattened chunk of entries that share a process group."""
    pieces = coalesce(chunk)
    first = chunk[0]
    return Collective(BACKWARD, op, first.group, first.process_group.size, root, bucket,
                      pieces[0][0], sum(n for _, n in pieces),
                      segments=pieces if len(pieces) > 1 else (),
                      itemsize=message_itemsize(spec, first.group, options))


def reduce_per_entry(spec: ModelSpec, zero: ZeroPartitioning, limit: int,
                     options: PlanOptions) -> list[Collective]:
    """<= v0.12.3: one async reduce per entry, in bucket-offset order (v0.9.0:L972-987)."""
    return [Collective(BACKWARD, "reduce", e.group, e.process_group.size, e.dst, bucket.index,
                       e.offset, e.numel, itemsize=message_itemsize(spec, e.group, options))
            for bucket, entries in zip(zero.buckets, zero.entries, strict=True) for e in entries]


def all_reduce_per_process_group(spec: ModelSpec, zero: ZeroPartitioning, limit: int,
                                 options: PlanOptions) -> list[Collective]:
    """v0.12.4+ default: per bucket, one all-reduce per process group per chunk
    (`allreduce_and_scatter`, @edaa72212:L1314-1348)."""
    out = []
    for bucket, entries in zip(zero.buckets, zero.entries, strict=True):
        by_pg: dict[object, list[ReduceEntry]] = {}
        for e in entries:
            by_pg.setdefault(e.process_group, []).append(e)
        for group_entries in by_pg.values():
            out += [flattened("all_reduce", spec, options, bucket.index, chunk, None)
                    for chunk in chunk_entries(group_entries, limit)]
    return out


def reduce_per_destination(spec: ModelSpec, zero: ZeroPartitioning, limit: int,
                           options: PlanOptions) -> list[Collective]:
    """`use_multi_rank_bucket_allreduce=False`: one reduce per (dst, process group) per
    chunk (`allreduce_no_retain`, @edaa72212:L1910-1941)."""
    out = []
    for bucket, entries in zip(zero.buckets, zero.entries, strict=True):
        by_dst: dict[object, list[ReduceEntry]] = {}
        for e in entries:
            by_dst.setdefault((e.dst, e.process_group), []).append(e)
        for (dst, _), dst_entries in by_dst.items():
            out += [flattened("reduce", spec, options, bucket.index, chunk, dst)
                    for chunk in chunk_entries(dst_entries, limit)]
    return out


def plan_with(strategy: str, dispatch: Dispatch, spec: ModelSpec, world_size: int,
              options: PlanOptions) -> Plan:
    check_has_params(spec)
    check_world_size(world_size, MAX_WORLD_SIZE)  # one call per rank piece: bounded memory
    infos = group_infos(spec, world_size)
    limit = options.fixed_bucket_numel or DEFAULT_REDUCE_BUCKET_SIZE
    zero = partition_zero(spec, infos, world_size, limit, options.round_robin)
    backward = dispatch(spec, zero, limit, options)
    norms = [Collective(STEP, "all_reduce", "world", world_size, None, None, 0, 1, itemsize=4)
             for _ in range(NORM_ALL_REDUCES)]
    step = norms + all_gathers(spec, infos, list(zero.layouts))
    plan = Plan(strategy, world_size, infos, zero.buckets, zero.layouts,
                tuple(backward + step), spec.arrival_order, tuple(notes(spec, zero, limit, options)),
                execution=EXECUTION, memory=MEMORY)
    # The fp32 master partition is a clone even for fp32 models (@edaa72212:L489-491), the
    # step's norm an fp64 copy (L2088-2090), and the update is copied back to the
    # parameters' partition before the all-gather (L2386): one pass over both. The
    # optimizer, DeepSpeed's FusedAdam for an "Adam"/"AdamW" config
    # (runtime/engine.py `_configure_basic_optimizer`), steps one flat partition per
    # group; the norm and the overflow check walk every parameter's gradient.
    return replace(plan, step_work=step_work(plan, spec, options, norm="fp64",
                                             optimizer_impl="fused",
                                             copied=lambda g: True, visits_params=True))


EXECUTION = Execution(max_in_flight=0, launch_in_order=True, copies_grads=True)
"""ZeRO-2's default `overlap_comm=False` (zero/config.py, v0.19.8): a flushed IPG bucket is
reduced on the compute stream, so backward waits for every flush's collectives."""

MEMORY = MemoryModel(GradsAtRest.MESSAGE_SHARD, reserved_buffer_numel=DEFAULT_REDUCE_BUCKET_SIZE,
                     in_flight_basis="IPG buffer of {reserved:,} elements")
"""The partition's gradients in the message dtype at rest (`averaged_gradients`), and one
IPG buffer of `reduce_bucket_size` elements allocated at its full size whatever the model
(`setup_buckets`, @edaa72212:L2493-2516; overlap_comm off, the ZeRO-2 default; on, it is
2). `evenzero.cost.memory` sizes it from the user's bucket size when one was given."""


def notes(spec: ModelSpec, zero: ZeroPartitioning, limit: int, options: PlanOptions) -> list[str]:
    out = [f"one reduce bucket of {limit:,} elements shared by all param groups, "
           f"filled in arrival order; {len(zero.buckets)} flush(es)"]
    if options.round_robin:
        out.append("round_robin_gradients: flat layouts interleaved across ranks")
    arrived = set(spec.arrival_order)
    missing = [p.name for p in spec.params if p.name not in arrived]
    if missing:
        out.append(f"{len(missing)} param(s) produce no gradient ({', '.join(missing[:3])}"
                   f"{', ...' if len(missing) > 3 else ''}): DeepSpeed issues no collective "
                   f"for them and their owners step on zeros, silently")
    oversized = [s.name for b in zero.buckets for s in b.params if s.numel > limit]
    if oversized:
        out.append(f"{len(oversized)} param(s) exceed the bucket and are reduced alone")
    return out


def plan_deepspeed_reduce(spec: ModelSpec, world_size: int,
                          options: PlanOptions | None = None) -> Plan:
    """DeepSpeed <= 0.12.3: one reduce per (destination, adjacent run)."""
    return plan_with("deepspeed-0.6", reduce_per_entry, spec, world_size,
                     options or PlanOptions())


def plan_deepspeed_allreduce(spec: ModelSpec, world_size: int,
                             options: PlanOptions | None = None) -> Plan:
    """DeepSpeed >= 0.12.4 default: one all-reduce per process group per bucket."""
    return plan_with("deepspeed", all_reduce_per_process_group, spec, world_size,
                     options or PlanOptions())


def plan_deepspeed_reduce_mode(spec: ModelSpec, world_size: int,
                               options: PlanOptions | None = None) -> Plan:
    """DeepSpeed >= 0.12.4 with use_multi_rank_bucket_allreduce=False."""
    return plan_with("deepspeed-reduce-mode", reduce_per_destination, spec, world_size,
                     options or PlanOptions())
