"""DeepSpeed ZeRO-1/2 partitioning and IPG buckets, as pure data.

Mirrors deepspeed/runtime/zero/stage_1_and_2.py at commit edaa72212 (after v0.19.5;
line numbers below are there):

* Flat layout (`__init__`, L389-466; `get_data_parallel_partitions`, L1966-1984): each
  param group is flattened in registration order (optionally round-robin reordered,
  L418-427), one zero pad is appended so the total is a multiple of `2 x dp_g`, and the
  flat buffer is cut into `dp_g` equal partitions. A param belongs to every partition
  it touches; one that starts exactly on a boundary belongs only to the later partition
  (`initialize_gradient_partition`, L1049-1098).
* IPG bucket (`reduce_independent_p_g_buckets_and_remove_grads`, L1193-1253): ONE
  bucket shared by every group fills in gradient-arrival order and is flushed *before*
  adding a param that would overflow it (L1201). A param larger than the bucket still
  enters it and forces a flush at the next arrival, so it goes alone.
* rank_and_offsets (`average_tensor`, L1376-1433): each param in the bucket is cut at
  its partition boundaries; a slice extends the previous entry only if it is adjacent
  in the bucket and has the same destination partition and the same process group.

Why `Bucket.group` is the label `IPG_GROUP`: a DeepSpeed IPG bucket mixes dense and
expert params (the seed case bucket holds both), so no param group owns it. Each
reduce entry carries the param group whose process group it runs on instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from evenzero.plan import Bucket, GroupInfo, PlanError, Slot, align_up
from evenzero.spec import ModelSpec

IPG_GROUP = "ipg"
"""`Bucket.group` of DeepSpeed's IPG buckets, which span param groups."""

NCCL_START_ALIGNMENT_FACTOR = 2
"""DeepSpeed pads each flat group to a multiple of this times the group's DP size."""


@dataclass(frozen=True)
class ProcessGroup:
    """A process group as DeepSpeed tells them apart when merging reduce entries."""

    key: str
    """"dp" for the data-parallel group; "edp<E>" for the expert-DP group of size world/E
    (DeepSpeed names expert groups "ep_size_<E>", so equal E means the same group)."""
    size: int
    """Ranks in the group."""


@dataclass(frozen=True)
class ParamPartitions:
    """Where one param sits in its group's flat layout."""

    group: str
    """Param group name."""
    start: int
    """Offset of the param's first element in the flat group buffer."""
    parts: tuple[tuple[int, int], ...]
    """(partition id, grad_start_offset) for every partition the param touches, by offset.
    Partition ids are group-local ranks (EDP-local for expert groups)."""
    process_group: ProcessGroup
    """The process group its slices are reduced on."""


@dataclass(frozen=True)
class ReduceEntry:
    """One row of DeepSpeed's `rank_and_offsets`: a run of the bucket bound for one rank."""

    dst: int
    """Destination partition id, local to the process group."""
    offset: int
    """Element offset of the run in the IPG bucket."""
    numel: int
    """Length of the run."""
    group: str
    """Param group of the run's first slice (its process group is `process_group`)."""
    process_group: ProcessGroup


@dataclass(frozen=True)
class ZeroPartitioning:
    """Everything DeepSpeed fixes at init and during one backward, for one world size."""

    layouts: tuple[Bucket, ...]
    """One flat, padded layout per param group; rank r owns the r-th equal slice."""
    params: dict[str, ParamPartitions]
    """Partition metadata per param name."""
    buckets: tuple[Bucket, ...]
    """IPG buckets in flush order (group `IPG_GROUP`); offsets are bucket-relative."""
    entries: tuple[tuple[ReduceEntry, ...], ...]
    """`rank_and_offsets` of each bucket, in bucket-offset order."""


def is_moe(info: GroupInfo) -> bool:
    """DeepSpeed MoE groups are those with an expert-DP group narrower than the world.

    A spec group with expert_parallel_size 1 is treated as an ordinary param group on
    the DP group; DeepSpeed would give ep_size=1 experts their own (equal-sized) group,
    which only changes merging across a dense/expert seam.
    """
    return info.expert_parallel_size > 1


def round_robin_order(names: list[str], num_partitions: int) -> list[str]:
    """`_round_robin_reorder`: param k goes to sub-list k % num_partitions, then concat."""
    return [names[k] for j in range(num_partitions) for k in range(j, len(names), num_partitions)]


def partition_parts(start: int, numel: int, partition_size: int) -> tuple[tuple[int, int], ...]:
    """(partition id, grad_start_offset) of every partition `[start, start+numel)` touches.

    Only the partitions the param actually crosses are visited, so the whole layout walk
    is O(params + partitions) instead of DeepSpeed's O(params x partitions) loop.
    """
    first = start // partition_size
    last = (start + numel - 1) // partition_size if numel else first
    return ((first, 0),) + tuple((p, p * partition_size - start) for p in range(first + 1, last + 1))


def flatten_group(spec: ModelSpec, info: GroupInfo, round_robin: bool,
                  process_group: ProcessGroup) -> tuple[Bucket, dict[str, ParamPartitions]]:
    """The group's flat layout and each param's partitions (L389-466, L1049-1098)."""
    names = [p.name for p in spec.group_params(info.name)]
    if round_robin:
        names = round_robin_order(names, info.size)
    slots, offset = [], 0
    for n in names:
        numel = spec.param(n).numel
        slots.append(Slot(n, offset, numel))
        offset += numel
    padded = align_up(offset, NCCL_START_ALIGNMENT_FACTOR * info.size)
    # DeepSpeed keeps `partition_size` as a float (len(flat) / dp); the padding makes it
    # integral, so integer arithmetic gives the same offsets without the 1024.0 noise.
    size = padded // info.size
    # Zero-size params never enter a bucket (L1195, #8280), so they need no partitions;
    # a group of only such params has no partitions at all.
    parts = {s.name: ParamPartitions(info.name, s.offset,
                                     partition_parts(s.offset, s.numel, size) if s.numel else (),
                                     process_group) for s in slots}
    return Bucket(info.name, 0, padded, tuple(slots)), parts


def fill_ipg_buckets(spec: ModelSpec, limit: int) -> list[Bucket]:
    """Arrival-order bucket fill with DeepSpeed's flush-before-add rule (L1193-1253)."""
    buckets: list[Bucket] = []
    slots: list[Slot] = []
    used = 0
    for name in spec.arrival_order:
        numel = spec.param(name).numel
        if numel == 0:
            continue
        # Strict `>`: a param of exactly `limit` elements still fits an empty bucket. A
        # param over the limit enters anyway, so the next arrival flushes it out alone.
        if used + numel > limit and slots:
            buckets.append(Bucket(IPG_GROUP, len(buckets), used, tuple(slots)))
            slots, used = [], 0
        slots.append(Slot(name, used, numel))
        used += numel
    if slots:  # the epilogue's final flush
        buckets.append(Bucket(IPG_GROUP, len(buckets), used, tuple(slots)))
    return buckets


def rank_and_offsets(bucket: Bucket, params: dict[str, ParamPartitions]) -> list[ReduceEntry]:
    """`rank_and_offsets` (L1376-1433): cut each param at partition boundaries; merge
    adjacent same-(dst, pg) runs.

    DeepSpeed puts an expert param on its EDP group only when the bucket holds an expert
    param, which is always true for the bucket that holds it, so each param's own process
    group is used directly.
    """
    entries: list[ReduceEntry] = []
    prev: tuple[int, ProcessGroup] | None = None
    cursor = 0
    for slot in bucket.params:
        meta = params[slot.name]
        for k, (dst, start) in enumerate(meta.parts):
            end = meta.parts[k + 1][1] if k + 1 < len(meta.parts) else slot.numel
            n = end - start
            key = (dst, meta.process_group)
            if key == prev:
                last = entries[-1]
                entries[-1] = ReduceEntry(last.dst, last.offset, last.numel + n, last.group,
                                          last.process_group)
            else:
                entries.append(ReduceEntry(dst, cursor, n, meta.group, meta.process_group))
            cursor += n
            prev = key
    return entries


def partition_zero(spec: ModelSpec, infos: tuple[GroupInfo, ...], world_size: int,
                   bucket_numel: int, round_robin: bool) -> ZeroPartitioning:
    """Flat layouts, IPG buckets and reduce entries for `spec` on `world_size` ranks."""
    if any(g.name == IPG_GROUP for g in infos):
        raise PlanError(f"param group name {IPG_GROUP!r} is reserved for DeepSpeed's shared "
                        f"reduce bucket; rename that group in the model spec")
    layouts: list[Bucket] = []
    params: dict[str, ParamPartitions] = {}
    for info in infos:
        pg = (ProcessGroup(f"edp{info.expert_parallel_size}", info.size) if is_moe(info)
              else ProcessGroup("dp", world_size))
        layout, parts = flatten_group(spec, info, round_robin, pg)
        layouts.append(layout)
        params.update(parts)
    buckets = fill_ipg_buckets(spec, bucket_numel)
    entries = tuple(tuple(rank_and_offsets(b, params)) for b in buckets)
    return ZeroPartitioning(tuple(layouts), params, tuple(buckets), entries)
