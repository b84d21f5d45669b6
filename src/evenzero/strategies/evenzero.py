"""evenzero's plan: arrival-ordered layout, equal shards, one reduce-scatter per bucket.

Per group, parameters are laid out contiguously in gradient-arrival order (params that
never produce a gradient go last) and cut into buckets without splitting a parameter.
Each bucket is padded to a multiple of `group_size x alignment`, and rank r owns the
r-th equal slice of every bucket. So the bucket is ready the moment its last gradient
arrives, and its reduction is a single equal reduce-scatter whose output is exactly the
owner's shard: no pieces, no merging, no root.

The bucket size is the user's, or by default the one with the shortest predicted step
within a memory budget (`choose_bucket`, over `evenzero.cost.autobucket`): a fixed
default cannot be right for both a 10M-parameter model (one 32M bucket means nothing
overlaps backward) and a 70B one on 1024 ranks (small buckets make every call mostly
latency).

What the runtime does with the options (`evenzero.runtime`), as the plan records it:

* stage 2 copies each bucket's gradients into a pooled buffer and keeps a master-dtype
  shard at rest, `max_buckets_in_flight` buffers alive during backward; stage 1 keeps a
  persistent buffer per bucket that gradients land in (no copy, unless the reduce dtype
  differs from the parameters') as well as the shard;
* the step computes the global gradient norm from fp32 chunks (combined in fp64) over
  the gradient shard, runs the inner optimizer on the shard (`optimizer_impl`, or
  `DEFAULT_OPTIMIZER_IMPL`), and all-gathers each layout, in the next forward with
  `overlap_param_gather`;
* fp32 parameters with fp32 masters: the master *is* the owned slice of the flat
  parameter buffer, so there is no master copy and nothing to copy in or out; other
  dtypes keep a separate master, checked against the parameters for the user's writes
  and written back each step (two passes over parameter and master).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from math import lcm

from evenzero.cost.autobucket import BucketChoice, choose_bucket_numel
from evenzero.cost.presets import PRESETS, default_cost_preset
from evenzero.plan import (
    BACKWARD,
    Bucket,
    Collective,
    Execution,
    GradsAtRest,
    GroupInfo,
    MemoryModel,
    Plan,
    PlanError,
    Slot,
    StepWork,
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
    group_infos,
    message_itemsize,
    step_work,
)
from evenzero.strategies.wholetensor import (
    AlignedBucket,
    align_bucket,
    balance_note,
    newton_schulz_flops,
)
from evenzero.wire import chunk_alignment

DEFAULT_OPTIMIZER_IMPL = "fused"
"""The inner optimizer implementation the runtime runs when the user chose none: torch's
fused kernels, on CPU and CUDA alike (torch.optim.AdamW(fused=True), torch >= 2.4);
the runtime passes the one it runs in `PlanOptions.optimizer_impl`."""
NORM = "fp32"
"""How the step computes the global gradient norm (`StepWork.norm`)."""
MASTER_PASSES = 2
"""Passes over parameter and master per step where they are separate: the check for
the user's writes, and the write-back of the update."""


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
    the one with the shortest predicted step (`choose_bucket`), and the plan's notes say
    which and why."""
    options = options or PlanOptions()
    if options.fixed_bucket_numel is None:
        return plan_auto(spec, world_size, options)
    return plan_fixed(spec, world_size, options)


def choose_bucket(spec: ModelSpec, world_size: int, options: PlanOptions) -> BucketChoice:
    """The bucket size with the shortest predicted step for `options`: their cost model
    (default: the preset for the world size) and compute (default: FLOPs estimates),
    within their memory budget (default: `evenzero.cost.autobucket`'s). The runtime calls
    it again after the first backwards with measured compute and a measured cost model."""
    check_has_params(spec)
    cost = options.cost_model or PRESETS[default_cost_preset(world_size)]

    def cut(numel: int) -> Plan:
        return plan_fixed(spec, world_size, replace(options, bucket_numel=numel))

    return choose_bucket_numel(spec, cost, cut, options.compute, options.bucket_memory_bytes,
                               options.reduce_dtype)


def plan_auto(spec: ModelSpec, world_size: int, options: PlanOptions) -> Plan:
    """The planner's default: `choose_bucket`'s plan, its note added."""
    choice = choose_bucket(spec, world_size, options)
    return replace(choice.plan, notes=choice.plan.notes + (choice.note,))


def plan_fixed(spec: ModelSpec, world_size: int, options: PlanOptions) -> Plan:
    """evenzero's plan with buckets of at most `options.bucket_numel` elements."""
    check_has_params(spec)
    infos = group_infos(spec, world_size)
    numel = {p.name: p.numel for p in spec.params}
    buckets: list[Bucket] = []
    notes = list(compression_notes(infos, options))
    check_whole_tensor(spec, options)
    ns_max = momentum_only = 0
    for g in infos:
        arrived, missing = group_arrival(spec, g.name)
        order = [n for n in arrived + missing if numel[n] > 0]
        align_elems = max(1, options.alignment_bytes // DTYPE_BYTES[g.dtype])
        if compressed(g, options):  # no int8 block straddles two ranks' chunks
            align_elems = lcm(align_elems, chunk_alignment(options.grad_compression,
                                                           options.compression_block))
        limit = options.fixed_bucket_numel
        whole = whole_tensor_flops(spec, g.name, options)
        if whole:
            aligned = align_group(g, order, numel, whole, limit, align_elems)
            buckets += aligned.buckets
            notes += aligned.notes
            ns_max += max(aligned.flops)
            momentum_only += max(aligned.whole_numel)
        else:
            for i, names in enumerate(cut_buckets(order, numel, limit)):
                slots, off = [], 0
                for n in names:
                    slots.append(Slot(n, off, numel[n]))
                    off += numel[n]
                buckets.append(Bucket(g.name, i, align_up(off, g.size * align_elems),
                                      tuple(slots)))
        if missing:
            notes.append(f"group {g.name}: {len(missing)} param(s) produce no gradient; "
                         f"laid out last and reduced as zeros")
    ordered = completion_order(spec, buckets)
    size = {g.name: g.size for g in infos}
    itemsize = {g.name: message_itemsize(spec, g.name, options) for g in infos}
    wire = {g.name: wire_of(g, options) for g in infos}
    backward = [Collective(BACKWARD, "reduce_scatter", b.group, size[b.group], None, b.index, 0,
                           b.numel, itemsize=itemsize[b.group], compression=wire[b.group][0],
                           block_numel=wire[b.group][1]) for b in ordered]
    step = [grad_check(spec, world_size)] + all_gathers(spec, infos, list(reversed(ordered)))
    casts = any(itemsize[g.name] != DTYPE_BYTES[g.dtype] for g in infos)
    plan = Plan("evenzero", world_size, infos, tuple(ordered), tuple(ordered),
                tuple(backward + step), spec.arrival_order, tuple(notes),
                execution=Execution(max_in_flight=options.max_buckets_in_flight,
                                    copies_grads=options.stage == 2 or casts,
                                    overlap_param_gather=options.overlap_param_gather,
                                    error_feedback=options.error_feedback),
                bucket_numel=options.fixed_bucket_numel,
                memory=memory_model(infos, options, casts, residual_numel=sum(
                    b.numel for b in ordered if options.error_feedback and wire[b.group][0]),
                    momentum_only_numel=momentum_only))
    aliased = set(plan.memory.aliased_groups)
    work = step_work(plan, spec, options, norm=NORM, optimizer_impl=DEFAULT_OPTIMIZER_IMPL,
                     copied=lambda g: g.name not in aliased, copy_passes=MASTER_PASSES,
                     visits_params=True)
    work = replace(work, matrix_flops=ns_max)
    if options.offload_optimizer is not None:
        work = offloaded_work(plan, work, options)
    return replace(plan, step_work=work)


@dataclass(frozen=True)
class AlignedGroup:
    """A group's buckets laid out matrix-aligned, and what `Plan.notes` says of them."""

    buckets: list[Bucket]
    notes: list[str]
    flops: list[int]
    """Newton-Schulz FLOPs per rank of the group, over all its buckets."""
    whole_numel: list[int]
    """Elements of whole-tensor parameters per rank of the group."""


def whole_tensor_flops(spec: ModelSpec, group: str, options: PlanOptions) -> dict[str, int]:
    """The group's whole-tensor parameters and the Newton-Schulz FLOPs of each."""
    wanted = set(options.whole_tensor)
    return {p.name: newton_schulz_flops(p.shape, options.ns_steps)
            for p in spec.group_params(group) if p.name in wanted and p.numel > 0}


CUT_REACH = 4
"""A matrix-aligned bucket may end anywhere between the bucket size and this many times
it, wherever its padding is least."""
CUT_SLACK = 0.005
"""The earliest end whose padding is within this fraction of the least is taken."""


def aligned_cut(order: list[str], numel: dict[str, int], whole: dict[str, int], size: int,
                align: int, limit: int, carried: list[int]) -> tuple[list[str], AlignedBucket]:
    """The next matrix-aligned bucket of `order`: its parameters and layout. A bucket cut
    at the size alone can hold too few matrices to share out evenly (at 8 ranks, 6
    up-projections and 8 attention matrices of a small Llama leave every slice 8% empty),
    so the end is the first one between `limit` and `CUT_REACH x limit` elements whose
    padding is within `CUT_SLACK`, else the earliest within `CUT_SLACK` of the least."""
    ends, used = [], 0
    for i, n in enumerate(order):
        used += numel[n]
        if used >= limit or i == len(order) - 1:
            ends.append(i + 1)
        if used >= CUT_REACH * limit:
            break
    tried = []
    for end in ends:
        names = order[:end]
        b = align_bucket(names, numel, {n: whole[n] for n in names if n in whole}, size,
                         align, carried)
        tried.append((names, b, (b.numel - sum(numel[n] for n in names)) / b.numel))
        if tried[-1][2] <= CUT_SLACK:
            return names, b
    least = min(f for _, _, f in tried)
    names, b, _ = next(t for t in tried if t[2] <= least + CUT_SLACK)
    return names, b


def check_whole_tensor(spec: ModelSpec, options: PlanOptions) -> None:
    """Every whole-tensor parameter exists and is a matrix (torch.optim.Muon's rule)."""
    shapes = {p.name: p.shape for p in spec.params}
    for n in options.whole_tensor:
        if n not in shapes:
            raise PlanError(f"whole_tensor names {n!r}, which is not a trainable parameter of "
                            f"the model; drop it")
        if len(shapes[n]) != 2:
            raise PlanError(f"parameter {n!r} has shape {list(shapes[n])}: a whole-tensor "
                            f"(Muon) update needs a 2-D matrix, as torch.optim.Muon requires; "
                            f"give it to an element-wise optimizer (AdamW) instead")


def align_group(g: GroupInfo, order: list[str], numel: dict[str, int], whole: dict[str, int],
                limit: int, align: int) -> AlignedGroup:
    """`g`'s buckets, matrix-aligned (`evenzero.strategies.wholetensor`), cut at `limit`
    elements or at `g.size` times its largest matrix, whichever is larger."""
    biggest = max(whole, key=lambda n: (numel[n], n))
    need = g.size * numel[biggest]
    notes = []
    if limit < need:
        notes.append(f"group {g.name}: buckets grown from {limit:,} to {need:,} elements so "
                     f"that each of the {g.size} ranks' slices can hold the largest matrix, "
                     f"{biggest} ({numel[biggest]:,} elements), whole")
        limit = need
    buckets, work, load = [], [0] * g.size, [0] * g.size
    start = 0
    while start < len(order):
        names, b = aligned_cut(order[start:], numel, whole, g.size, align, limit, work)
        start += len(names)
        work = [a + w for a, w in zip(work, b.flops, strict=True)]
        load = [a + w for a, w in zip(load, b.whole_numel, strict=True)]
        buckets.append(Bucket(g.name, len(buckets), b.numel, b.slots))
    padding = sum(b.padding for b in buckets)
    notes.append(balance_note(g.name, work, padding, g.numel))
    return AlignedGroup(buckets, notes, work, load)


OFFLOAD_IMPL = "fused"
"""The host step's implementation: torch's fused CPU kernel for Adam/AdamW, the one
`runtime/innerstep.py` picks for fp32 shards on the CPU."""


def offloaded_work(plan: Plan, work: StepWork, options: PlanOptions) -> StepWork:
    """The step of `runtime/offload.py`: the optimizer on the host, and per shard element
    the gradient (master dtype) to the host during the backward, then the parameter
    (its dtype) back to the host for the user's writes and the update to the device. The
    masters' copies are host-side, so the device copies nothing."""
    master = DTYPE_BYTES[options.master_dtype]
    shard = {g.name: plan.shard_numel(g.name) for g in plan.groups}
    return replace(work, copy_bytes=0, host_step=True,
                   optimizer_impl=options.optimizer_impl or OFFLOAD_IMPL,
                   host_link_bytes=sum(2 * shard[g.name] * DTYPE_BYTES[g.dtype]
                                       for g in plan.groups),
                   host_link_backward_bytes=sum(shard.values()) * master)


def aliased_groups(infos: tuple[GroupInfo, ...], options: PlanOptions) -> tuple[str, ...]:
    """Groups whose master is the owned slice of their flat parameter buffer: fp32
    parameters with fp32 masters."""
    if options.master_dtype != "float32":
        return ()
    return tuple(g.name for g in infos if g.dtype == "float32")


def compressed(g: GroupInfo, options: PlanOptions) -> bool:
    """Whether `g`'s buckets travel compressed: a mode is set and the group has ranks to
    send to (on a group of one nothing is sent, so there is nothing to compress)."""
    return options.grad_compression is not None and g.size > 1


def wire_of(g: GroupInfo, options: PlanOptions) -> tuple[str | None, int]:
    """(compression, elements per int8 scale) of `g`'s backward collectives."""
    if not compressed(g, options):
        return None, 0
    mode = options.grad_compression
    return mode, options.compression_block if mode == "int8" else 0


def compression_notes(infos: tuple[GroupInfo, ...], options: PlanOptions) -> list[str]:
    """Refuse what compression cannot do, and note where it does nothing."""
    mode = options.grad_compression
    if mode is None:
        return []
    if mode == "int8":
        wide = [g.name for g in infos if g.size > 1 and "float64" in (g.dtype, options.reduce_dtype)]
        if wide:
            raise PlanError(f"grad_compression=\"int8\" cannot carry the float64 gradients of "
                            f"group(s) {', '.join(wide)}: 7 bits per value would throw away what "
                            f"float64 training keeps; use grad_compression=None (exact) or train "
                            f"in float32")
    alone = [g.name for g in infos if g.size == 1]
    if not alone:
        return []
    return [f"grad_compression={mode!r} does nothing for group(s) {', '.join(alone)}: a group "
            f"of one rank sends nothing, so its gradients stay exact"
            + (" and keep no residual" if options.error_feedback else "")]


def memory_model(infos: tuple[GroupInfo, ...], options: PlanOptions, casts: bool,
                 residual_numel: int = 0, momentum_only_numel: int = 0) -> MemoryModel:
    """Gradient and optimizer memory as the runtime holds it (module docstring)."""
    n = options.max_buckets_in_flight
    buckets = f"{n} bucket{'s' if n > 1 else ''} in flight"
    if options.stage == 2:
        grads, held, basis = GradsAtRest.MASTER_SHARD, n, buckets
    else:  # the gradients land in their buffers; only a cast needs a pooled copy
        grads, held, basis = GradsAtRest.BUFFERS_AND_SHARD, n if casts else 0, ""
        if casts:
            basis = f"{n} cast bucket{'s' if n > 1 else ''} in flight"
    offloaded = options.offload_optimizer is not None
    return MemoryModel(grads, buckets_in_flight=held, in_flight_basis=basis,
                       master_itemsize=DTYPE_BYTES[options.master_dtype],
                       aliased_groups=() if offloaded else aliased_groups(infos, options),
                       residual_numel=residual_numel,
                       momentum_only_numel=momentum_only_numel, offloaded=offloaded)


def grad_check(spec: ModelSpec, world_size: int) -> Collective:
    """The step's one small all-reduce (`evenzero.plan.step_check`)."""
    return step_check(world_size, len(spec.params))
