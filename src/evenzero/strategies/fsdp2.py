"""PyTorch FSDP2 in ZeRO-2 mode: `fully_shard(reshard_after_forward=False)` per block.

FSDP units. The planner only sees parameter names, so it applies the usual wrapping
policy (torchtitan, most FSDP2 recipes: one `fully_shard` per numbered block, then one
on the root): a param's unit is its name up to and including the first all-digit path
component (`layers.3.attn.q.weight` -> `layers.3`, `moe.experts.2.fc1.bias` ->
`moe.experts.2`); a param with no such component belongs to its group's root unit.
Expert params form their own units over their expert-DP group (a per-param mesh via
`shard_placement_fn`), even when they share a block prefix with dense params.

Sharding. Every param is chunked on dim 0 into W pieces after padding dim 0 up to a
multiple of W, so rank r owns rows [r*c, (r+1)*c) of every param, c = ceil(d0 / W).
That ownership is per param, not per unit, so `Plan.layouts` holds one layout per param
(its padded numel, the param at offset 0): the r-th equal slice of it is exactly
FSDP2's shard. `Plan.buckets` are the units; Slot offsets there are positions in the
concatenation of the padded params (the reduce-scatter input before `_chunk_cat`
interleaves the rank chunks), so a unit's numel is its reduce-scatter input size.

Schedule. One `reduce_scatter_tensor` per unit when its module's backward finishes
(the last gradient of the unit arrives); root units reduce in the final backward
callback, after every block. The step re-gathers each unit once in the next forward:
root first, then blocks in registration (forward) order.
"""

from __future__ import annotations

import math
from dataclasses import replace

from evenzero.plan import (
    BACKWARD,
    STEP,
    Bucket,
    Collective,
    Execution,
    GradsAtRest,
    GroupInfo,
    MemoryModel,
    Plan,
    Slot,
)
from evenzero.spec import DTYPE_BYTES, ModelSpec, ParamSpec
from evenzero.strategies.common import (
    PlanOptions,
    check_has_params,
    group_dtype,
    group_infos,
    message_itemsize,
    per_param,
    step_work,
)

ROOT_UNIT = ""
"""Unit prefix of params outside every numbered block."""


def unit_prefix(name: str) -> str:
    """The block a param is wrapped with: its name up to the first all-digit component."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ROOT_UNIT


def padded_numel(shape: tuple[int, ...], group_size: int) -> int:
    """`_get_dim0_padded_size`: dim 0 rounded up to a multiple of W; scalars act as (1,)."""
    dims = shape or (1,)
    return -(-dims[0] // group_size) * group_size * math.prod(dims[1:])


def group_units(spec: ModelSpec, info: GroupInfo) -> dict[str, list[ParamSpec]]:
    """The group's units, keyed by prefix, params in registration order."""
    units: dict[str, list[ParamSpec]] = {}
    for p in spec.group_params(info.name):
        units.setdefault(unit_prefix(p.name), []).append(p)
    return units


def unit_bucket(info: GroupInfo, index: int, params: list[ParamSpec]) -> Bucket:
    slots, offset = [], 0
    for p in params:
        slots.append(Slot(p.name, offset, p.numel))
        offset += padded_numel(p.shape, info.size)
    return Bucket(info.name, index, offset, tuple(slots))


def param_layouts(spec: ModelSpec, info: GroupInfo, units: list[Bucket]) -> list[Bucket]:
    """One layout per param, so the r-th equal slice is FSDP2's dim-0 chunk r."""
    params = [spec.param(s.name) for u in units for s in u.params]
    return [Bucket(info.name, i, padded_numel(p.shape, info.size), (Slot(p.name, 0, p.numel),))
            for i, p in enumerate(params)]


def reduce_scatter(spec: ModelSpec, unit: Bucket, group_size: int,
                   options: PlanOptions, arrived: set[str]) -> Collective | None:
    """`foreach_reduce` packs only the params that have a gradient; none means no call."""
    pieces = [(s.offset, padded_numel(spec.param(s.name).shape, group_size))
              for s in unit.params if s.name in arrived]
    if not pieces:
        return None
    joined: list[tuple[int, int]] = []
    for off, n in pieces:
        if joined and sum(joined[-1]) == off:
            joined[-1] = (joined[-1][0], joined[-1][1] + n)
        else:
            joined.append((off, n))
    return Collective(BACKWARD, "reduce_scatter", unit.group, group_size, None, unit.index,
                      joined[0][0], sum(n for _, n in joined),
                      segments=tuple(joined) if len(joined) > 1 else (),
                      itemsize=message_itemsize(spec, unit.group, options))


def plan_fsdp2(spec: ModelSpec, world_size: int, options: PlanOptions | None = None) -> Plan:
    options = options or PlanOptions()
    check_has_params(spec)
    infos = group_infos(spec, world_size)
    position = {n: i for i, n in enumerate(spec.arrival_order)}
    registration = {p.name: i for i, p in enumerate(spec.params)}
    arrived = set(position)

    def finished(unit: Bucket) -> int:
        """Arrival position of the unit's last gradient; units with none sort last."""
        return max((position[s.name] for s in unit.params if s.name in arrived),
                   default=len(position))

    blocks: list[Bucket] = []
    roots: list[Bucket] = []
    layouts: list[Bucket] = []
    for info in infos:
        units = group_units(spec, info)
        # Index each group's blocks in the order they reduce; the root unit comes last.
        group_blocks = sorted((unit_bucket(info, 0, ps) for prefix, ps in units.items()
                               if prefix != ROOT_UNIT), key=finished)
        group_blocks = [replace(b, index=i) for i, b in enumerate(group_blocks)]
        group_root = ([unit_bucket(info, len(group_blocks), units[ROOT_UNIT])]
                      if ROOT_UNIT in units else [])
        blocks += group_blocks
        roots += group_root
        layouts += param_layouts(spec, info, group_blocks + group_root)
    group_rank = {g.name: i for i, g in enumerate(infos)}
    issued = sorted(blocks, key=lambda b: (finished(b), group_rank[b.group])) + roots
    size = {g.name: g.size for g in infos}
    backward = [c for b in issued
                if (c := reduce_scatter(spec, b, size[b.group], options, arrived)) is not None]
    forward = roots + sorted(blocks, key=lambda b: registration[b.params[0].name])
    step = [Collective(STEP, "all_gather", b.group, size[b.group], None, b.index, 0, b.numel,
                       itemsize=DTYPE_BYTES[group_dtype(spec, b.group)]) for b in forward]
    plan = Plan("fsdp2", world_size, infos, tuple(issued), tuple(layouts),
                tuple(backward + step), spec.arrival_order, tuple(notes(spec, layouts, options)),
                execution=EXECUTION, memory=MEMORY)
    # The optimizer steps the sharded parameters themselves (_fsdp_param.py L316-331): no
    # master to copy; the user's optimizer with torch's default implementation, no norm.
    return replace(plan, step_work=step_work(plan, spec, options, tensors=per_param(spec)))


EXECUTION = Execution(max_in_flight=1, launch_in_order=False, copies_grads=True,
                      missing_grads_hold_bucket=False, overlap_param_gather=True)
"""A unit's post-backward waits for the previous unit's reduce-scatter before issuing its
own (one in flight), after `_chunk_cat` copies the gradients in; units reduce only the
gradients they got; parameters are all-gathered in the next forward."""

MEMORY = MemoryModel(GradsAtRest.MASTER_SHARD, buckets_in_flight=1,
                     in_flight_basis="one unit's RS input")
"""fp32 sharded gradients (padded per parameter, as the layouts say) at rest; one unit's
reduce-scatter input in flight, the next one waiting on it
(_fsdp_collectives.py `foreach_reduce`)."""


def notes(spec: ModelSpec, layouts: list[Bucket], options: PlanOptions) -> list[str]:
    padding = sum(b.padding for b in layouts)
    out = [f"per-param dim-0 padding: {padding:,} elements in all; the reduce-scatter input "
           f"is a fresh buffer filled by _chunk_cat each backward"]
    arrived = set(spec.arrival_order)
    missing = [p.name for p in spec.params if p.name not in arrived]
    if missing:
        out.append(f"{len(missing)} param(s) produce no gradient; FSDP2 leaves them out of "
                   f"their unit's reduce-scatter")
    if options.round_robin:
        out.append("round_robin applies to DeepSpeed only; ignored")
    if options.fixed_bucket_numel:
        out.append("bucket size ignored: FSDP2 reduces one unit (wrapped module) per call")
    return out
