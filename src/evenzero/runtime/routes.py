"""Per-rank routes through a plan: which bucket elements this rank must keep, and where.

A plan says, for every bucket, which collectives reduce it and which rank owns which
elements afterwards. Before the runtime executes a plan it turns it into one
`BucketRoute` per bucket for this rank, and proves on paper that the collectives really
deliver every owned element to this rank. A plan that does not (a planner bug, a
hand-built plan with a wrong root) is rejected at construction with a `PlanError`
instead of training on zeros.

Pure Python on purpose: no tensors, so it is cheap to property-test.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from evenzero.plan import Bucket, Collective, Plan, PlanError

REDUCING_OPS = ("reduce", "all_reduce", "reduce_scatter")


@dataclass(frozen=True)
class OwnedPiece:
    """A run of bucket elements this rank keeps, and where it goes in its shard."""

    bucket_offset: int
    """Offset of the run inside the bucket buffer."""
    shard_offset: int
    """Offset of the run inside this rank's flat shard of the group."""
    numel: int
    """Length of the run."""


@dataclass(frozen=True)
class BucketRoute:
    """How this rank reduces one plan bucket."""

    position: int
    """Index of the bucket in `plan.buckets` (its launch position)."""
    bucket: Bucket
    """The plan's bucket."""
    collectives: tuple[Collective, ...]
    """The plan's backward collectives on this bucket, in issue order."""
    owned: tuple[OwnedPiece, ...]
    """Runs of the reduced bucket this rank keeps."""
    direct_shard_offset: int | None
    """Set when the bucket is one of the group's layouts and is reduced by one equal
    reduce-scatter of the whole bucket (evenzero, Megatron): this rank's output chunk
    *is* its shard slice starting here, so it is accumulated without piecewise copies."""
    gaps: tuple[tuple[int, int], ...]
    """(offset, numel) ranges of the bucket not covered by any parameter (padding),
    which must be zero before the bucket is reduced."""


def _intervals_delivered(c: Collective, group_rank: int) -> list[tuple[int, int]]:
    """Bucket ranges [a, b) whose reduced values this rank holds after `c`."""
    pieces = c.pieces()
    if c.op == "reduce":
        return [(o, o + n) for o, n in pieces] if c.root == group_rank else []
    if c.op == "all_reduce":
        return [(o, o + n) for o, n in pieces]
    # reduce_scatter: the flattened message is cut into group_size equal chunks.
    total = sum(n for _, n in pieces)
    chunk = total // c.group_size
    lo, hi = group_rank * chunk, (group_rank + 1) * chunk
    out, pos = [], 0
    for o, n in pieces:
        a, b = max(lo, pos), min(hi, pos + n)
        if a < b:
            out.append((o + a - pos, o + b - pos))
        pos += n
    return out


def _covered(piece: tuple[int, int], intervals: Sequence[tuple[int, int]]) -> bool:
    a, b = piece
    for lo, hi in sorted(intervals):
        if lo <= a < hi:
            a = hi
            if a >= b:
                return True
    return a >= b


def _check_collective(c: Collective, bucket_numel: dict[tuple[str, int], int]) -> None:
    where = f"backward collective {c.op} on group {c.group!r} bucket {c.buffer_index}"
    if c.op not in REDUCING_OPS:
        raise PlanError(f"{where}: the runtime executes only {', '.join(REDUCING_OPS)} in "
                        f"backward; use a sharded strategy such as 'evenzero'")
    if c.buffer_index is None or (c.group, c.buffer_index) not in bucket_numel:
        raise PlanError(f"{where}: names no bucket of the plan")
    size = bucket_numel[(c.group, c.buffer_index)]
    for o, n in c.pieces():
        if o < 0 or n < 0 or o + n > size:
            raise PlanError(f"{where}: piece ({o}, {n}) lies outside the bucket of {size} elements")
    if c.op == "reduce_scatter" and sum(n for _, n in c.pieces()) % c.group_size:
        raise PlanError(f"{where}: message is not divisible by the group size {c.group_size}")
    if c.op == "reduce" and (c.root is None or not 0 <= c.root < c.group_size):
        raise PlanError(f"{where}: reduce root {c.root} is not a rank of a group of {c.group_size}")


def plan_routes(plan: Plan, group_ranks: dict[str, int]) -> tuple[BucketRoute, ...]:
    """One route per `plan.buckets` entry for the rank whose group-local ranks are given.

    Raises `PlanError` if the plan cannot be executed as is: collectives out of bucket
    order, a parameter split across buckets, or an owned element that no collective
    delivers to this rank.
    """
    bucket_numel = {(b.group, b.index): b.numel for b in plan.buckets}
    if len(bucket_numel) != len(plan.buckets):
        raise PlanError("plan lists the same (group, bucket index) twice")
    position = {(b.group, b.index): i for i, b in enumerate(plan.buckets)}
    per_bucket: list[list[Collective]] = [[] for _ in plan.buckets]
    last = -1
    sizes = {g.name: g.size for g in plan.groups}
    for c in plan.backward():
        _check_collective(c, bucket_numel)
        if c.group_size != sizes.get(c.group):
            raise PlanError(f"backward {c.op} on group {c.group!r} claims {c.group_size} ranks but "
                            f"the group has {sizes.get(c.group)}")
        pos = position[(c.group, c.buffer_index)]
        if pos < last:
            raise PlanError(f"backward collectives of bucket {c.buffer_index} of group {c.group!r} are "
                            f"issued after a later bucket's; the runtime launches buckets in "
                            f"plan order, so list collectives in `plan.buckets` order")
        last = pos
        per_bucket[pos].append(c)

    slot_home: dict[str, tuple[int, int]] = {}
    for pos, b in enumerate(plan.buckets):
        for s in b.params:
            if s.name in slot_home:
                raise PlanError(f"parameter {s.name!r} appears in two buckets; the runtime needs "
                                f"each parameter whole in exactly one bucket")
            slot_home[s.name] = (pos, s.offset)

    owned: list[list[OwnedPiece]] = [[] for _ in plan.buckets]
    for g in plan.groups:
        for r in plan.shard_ranges(g.name, group_ranks[g.name]):
            if r.param not in slot_home:
                continue  # never reduced: the owner keeps zeros (see `unreduced`)
            pos, slot_offset = slot_home[r.param]
            owned[pos].append(OwnedPiece(slot_offset + r.start, r.shard_offset, r.numel))

    routes = []
    for pos, b in enumerate(plan.buckets):
        rank = group_ranks[b.group]
        delivered = [iv for c in per_bucket[pos] for iv in _intervals_delivered(c, rank)]
        for p in owned[pos]:
            if not _covered((p.bucket_offset, p.bucket_offset + p.numel), delivered):
                raise PlanError(f"plan does not deliver elements [{p.bucket_offset}, "
                                f"{p.bucket_offset + p.numel}) of bucket {b.index} of group "
                                f"{b.group!r} to their owner, group rank {rank}")
        routes.append(BucketRoute(pos, b, tuple(per_bucket[pos]),
                                  tuple(sorted(owned[pos], key=lambda p: p.bucket_offset)),
                                  _direct_offset(plan, b, per_bucket[pos]), _gaps(b)))
    return tuple(routes)


def unreduced(plan: Plan) -> tuple[str, ...]:
    """Parameters that are laid out (owned) but in no bucket: the plan never reduces them.

    DeepSpeed's plans do this for parameters that produced no gradient in the measured
    arrival order; their owners step on zeros. The runtime refuses a gradient for one.
    """
    in_bucket = {s.name for b in plan.buckets for s in b.params}
    return tuple(s.name for lay in plan.layouts for s in lay.params
                 if s.numel and s.name not in in_bucket)


def _direct_offset(plan: Plan, b: Bucket, colls: list[Collective]) -> int | None:
    if len(colls) != 1:
        return None
    c = colls[0]
    if c.op != "reduce_scatter" or c.segments or c.offset != 0 or c.numel != b.numel:
        return None
    for layout, shard in zip(plan.group_layouts(b.group), plan.layout_shards(b.group),
                             strict=True):
        if layout == b:
            return shard.shard_offset
    return None


def _gaps(b: Bucket) -> tuple[tuple[int, int], ...]:
    out, pos = [], 0
    for s in sorted(b.params, key=lambda s: s.offset):
        if s.offset > pos:
            out.append((pos, s.offset - pos))
        pos = max(pos, s.offset + s.numel)
    if b.numel > pos:
        out.append((pos, b.numel - pos))
    return tuple(out)
