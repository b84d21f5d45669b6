"""evenzero's plan: arrival-ordered layout, equal shards, one reduce-scatter per bucket.

Per group, parameters are laid out contiguously in gradient-arrival order (params that
never produce a gradient go last) and cut into buckets without splitting a parameter.
Each bucket is padded to a multiple of `group_size x alignment`, and rank r owns the
r-th equal slice of every bucket. So the bucket is ready the moment its last gradient
arrives, and its reduction is a single equal reduce-scatter whose output is exactly the
owner's shard: no pieces, no merging, no root.

The bucket size is the user's, or by default the one with the shortest predicted step
within a memory budget (`evenzero.cost.autobucket`): a fixed default cannot be right for
both a 10M-parameter model (one 32M bucket means nothing overlaps backward) and a 70B
one on 1024 ranks (small buckets make every call mostly latency).
"""

from __future__ import annotations

from evenzero.plan import (
    BACKWARD,
    Bucket,
    Collective,
    Execution,
    Plan,
    Slot,
    align_up,
    step_check,
)
from evenzero.spec import DTYPE_BYTES, ModelSpec
from evenzero.strategies.common import (
    PlanOptions,
    all_gathers,
    check_has_params,
    completion_order,
    group_arrival,
    group_dtype,
    group_infos,
    message_itemsize,
)


def cut_buckets(names: list[str], numel: dict[str, int], limit: int) -> list[list[str]]:
    """Greedy contiguous cut: a param never straddles buckets; an oversized one is alone."""
    out: list[list[str]] = []
    cur: list[str] = []
    used = 0
    for n in names:
        if cur and used + numel[n] > limit:
            out.append(cur)
            cur, used = [], 0
        cur.append(n)
        used += numel[n]
    if cur:
        out.append(cur)
    return out


def plan_evenzero(spec: ModelSpec, world_size: int, options: PlanOptions | None = None) -> Plan:
    """evenzero's plan. Without a fixed `bucket_numel` (None or "auto") the bucket size is
    the one with the shortest predicted step (`evenzero.cost.autobucket`), and the plan's
    notes say which and why."""
    options = options or PlanOptions()
    if options.fixed_bucket_numel is None:
        check_has_params(spec)
        # Imported here: the cost package imports the planners.
        from evenzero.cost.autobucket import plan_auto

        return plan_auto(spec, world_size, options)
    return plan_fixed(spec, world_size, options)


def plan_fixed(spec: ModelSpec, world_size: int, options: PlanOptions) -> Plan:
    """evenzero's plan with buckets of at most `options.bucket_numel` elements."""
    check_has_params(spec)
    infos = group_infos(spec, world_size)
    numel = {p.name: p.numel for p in spec.params}
    buckets: list[Bucket] = []
    notes = []
    for g in infos:
        arrived, missing = group_arrival(spec, g.name)
        order = [n for n in arrived + missing if numel[n] > 0]
        dtype = group_dtype(spec, g.name)
        align_elems = max(1, options.alignment_bytes // DTYPE_BYTES[dtype])
        limit = options.fixed_bucket_numel
        for i, names in enumerate(cut_buckets(order, numel, limit)):
            slots, off = [], 0
            for n in names:
                slots.append(Slot(n, off, numel[n]))
                off += numel[n]
            buckets.append(Bucket(g.name, i, align_up(off, g.size * align_elems), tuple(slots)))
        if missing:
            notes.append(f"group {g.name}: {len(missing)} param(s) produce no gradient; "
                         f"laid out last and reduced as zeros")
    ordered = completion_order(spec, buckets)
    size = {g.name: g.size for g in infos}
    itemsize = {g.name: message_itemsize(spec, g.name, options) for g in infos}
    backward = [Collective(BACKWARD, "reduce_scatter", b.group, size[b.group], None, b.index, 0,
                           b.numel, itemsize=itemsize[b.group]) for b in ordered]
    step = [grad_check(spec, world_size)] + all_gathers(spec, infos, list(reversed(ordered)))
    return Plan("evenzero", world_size, infos, tuple(ordered), tuple(ordered),
                tuple(backward + step), spec.arrival_order, tuple(notes),
                execution=Execution(max_in_flight=options.max_buckets_in_flight),
                bucket_numel=options.fixed_bucket_numel)


def grad_check(spec: ModelSpec, world_size: int) -> Collective:
    """The step's one small all-reduce (`evenzero.plan.step_check`)."""
    return step_check(world_size, len(spec.params))
