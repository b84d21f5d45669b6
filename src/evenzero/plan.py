"""The plan: what every strategy produces and what the runtime executes.

A `Plan` is pure data (frozen dataclasses, no tensors). It answers three questions
about one model under one strategy on one world size:

* where each parameter's gradient sits while it is being reduced (`buckets`);
* which rank owns which elements afterwards (`layouts`, sliced equally per rank);
* which collectives are issued, in which order (`collectives`).

A bucket and a layout are the same kind of record, a `FlatBuffer` of whole parameters,
in two roles: `Bucket` and `Layout` name the role.

For evenzero and Megatron the communication bucket *is* the ownership layout, so a
bucket is one reduce-scatter. DeepSpeed lays out ownership in registration order but
fills its buckets in arrival order, which is the whole seed-case problem; the two
lists differ and the collectives are reduces of the pieces.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property


class PlanError(ValueError):
    """Bad planning input (world size, bucket size, groups); the message names the fix."""


BACKWARD = "backward"
STEP = "step"


@dataclass(frozen=True)
class Slot:
    """One whole parameter placed inside a bucket or a layout."""

    name: str
    """Parameter name, as in `named_parameters()`."""
    offset: int
    """Element offset of the parameter's first element inside its buffer."""
    numel: int
    """Number of elements of the parameter."""


@dataclass(frozen=True)
class FlatBuffer:
    """A flat buffer of whole parameters of one group, in one of two roles:

    * a `Bucket` (`Plan.buckets`): where gradients sit while the backward collectives
      reduce them;
    * a `Layout` (`Plan.layouts`): the unit of ownership; rank r of the group owns the
      r-th equal slice of it, and the step all-gathers it.

    For evenzero and Megatron each bucket *is* a layout (the same record in both lists);
    `numel` then includes the padding that makes it divisible by the group size times the
    alignment.
    """

    group: str
    """Name of the parameter group the buffer belongs to."""
    index: int
    """Position of the buffer within its group and role (0-based)."""
    numel: int
    """Elements in the buffer, padding included."""
    params: tuple[Slot, ...]
    """The parameters in buffer order, with their offsets."""

    @property
    def used(self) -> int:
        return sum(s.numel for s in self.params)

    @property
    def padding(self) -> int:
        return self.numel - self.used


Bucket = FlatBuffer
"""A flat buffer in its communication role (`Plan.buckets`)."""
Layout = FlatBuffer
"""A flat buffer in its ownership role (`Plan.layouts`)."""


@dataclass(frozen=True)
class LayoutShard:
    """Where one layout's equal slice sits in each rank's flat shard of its group."""

    layout: int
    """Index of the layout within its group."""
    shard_offset: int
    """Offset of the layout's slice in the rank's shard (the same on every rank)."""
    numel: int
    """Elements of the slice: the layout's numel over the group size."""


@dataclass(frozen=True)
class ShardRange:
    """A contiguous run of one parameter's elements owned by one rank."""

    param: str
    """Parameter name."""
    rank: int
    """Owning rank, local to the group's process group."""
    start: int
    """Offset of the run inside the flattened parameter."""
    numel: int
    """Length of the run."""
    layout: int
    """Index of the layout (within its group) that holds the run."""
    layout_offset: int
    """Offset of the run inside that layout."""
    shard_offset: int
    """Offset of the run inside the owner's flat shard of the whole group."""


@dataclass(frozen=True)
class Collective:
    """One collective call, as planned or as issued (the runtime's trace uses it too)."""

    phase: str
    """"backward" (gradient reduction) or "step" (norms and parameter all-gather)."""
    op: str
    """One of reduce, reduce_scatter, all_reduce, all_gather."""
    group: str
    """Parameter group name, or "world" for a collective over every rank."""
    group_size: int
    """Ranks in the process group the call runs on."""
    root: int | None
    """Group-local destination rank of a reduce; None otherwise."""
    buffer_index: int | None
    """Index within `group` of the flat buffer the call works on: for a backward
    collective the bucket it reduces (also readable as `bucket`); for a step all-gather
    the buffer it fills, a layout (an FSDP2 unit, i.e. a bucket, for "fsdp2"); None for
    whole-group calls such as the step's norm all-reduce."""
    offset: int
    """Element offset of the message inside that buffer."""
    numel: int
    """Elements in the message (a reduce-scatter's full input, an all-gather's full output)."""
    segments: tuple[tuple[int, int], ...] = ()
    """(offset, numel) pieces that are flattened into one message, when not contiguous."""
    itemsize: int = 4
    """Bytes per element of the message."""
    algorithm: str = field(default="", compare=False)
    """How the runtime carried out the op (e.g. "all_to_all+sum"); not part of equality."""

    @property
    def bucket(self) -> int | None:
        """The bucket a backward collective reduces (None for step collectives)."""
        return self.buffer_index if self.phase == BACKWARD else None

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    def pieces(self) -> tuple[tuple[int, int], ...]:
        return self.segments or ((self.offset, self.numel),)


STEP_CHECK_EXTRA = 5
"""Elements of the step check after the per-parameter presence values: the squared
norm, the overflow flag, the flag for problems a rank found alone in backward, and the
rank's number of backwards under no_sync() and its square."""


def step_check(world_size: int, num_params: int) -> Collective:
    """The step's one small fp64 all-reduce over the world (evenzero's plans and runtime):
    a presence value per parameter (whether it produced a gradient on the rank, and
    whether the rank holds one at all, so a gradient that exists on some ranks only is
    caught by name and one that exists on none is not stepped), the global squared norm,
    the overflow flag, the problem flag (so every rank raises what one rank found, and
    none waits) and the no_sync() micro-batch count with its square (equal on every rank
    exactly when W * sum(c^2) == sum(c)^2). fp64 keeps the sums exact on any world."""
    return Collective(STEP, "all_reduce", "world", world_size, None, None, 0,
                      num_params + STEP_CHECK_EXTRA, itemsize=8)


class Schedule(tuple):
    """Collectives in issue order: a plain tuple (equal to one holding the same calls)
    that prints as a table."""

    __slots__ = ()

    def __str__(self) -> str:
        return format_schedule(self)


def format_schedule(calls: Iterable[Collective]) -> str:
    """One row per call: op, group, ranks, root, buffer (bucket or layout index), offset
    in it, elements (and segments), bytes per element and, for a runtime trace, how the
    call was carried out."""
    head = ("#", "phase", "op", "group", "ranks", "root", "buffer", "offset", "elements",
            "bytes/el", "algorithm")
    rows = [head]
    for i, c in enumerate(calls):
        where = "-" if c.buffer_index is None else str(c.buffer_index)
        size = f"{c.numel:,}" + (f" in {len(c.segments)}" if c.segments else "")
        rows.append((str(i), c.phase, c.op, c.group, str(c.group_size),
                     "-" if c.root is None else str(c.root), where, f"{c.offset:,}", size,
                     str(c.itemsize), c.algorithm or "-"))
    if len(rows) == 1:
        return "(no collectives)"
    widths = [max(len(r[k]) for r in rows) for k in range(len(head))]
    right = {0, 4, 7, 8, 9}
    return "\n".join("  ".join(cell.rjust(w) if k in right else cell.ljust(w)
                               for k, (cell, w) in enumerate(zip(r, widths, strict=True))).rstrip()
                     for r in rows)


@dataclass(frozen=True)
class GroupInfo:
    """A parameter group and the process group it is reduced over."""

    name: str
    size: int
    """Data-parallel size of the group (world / expert_parallel_size for experts)."""
    expert_parallel_size: int = 1
    """1 for dense groups. For experts, the group of rank r is {r % E + k*E}."""
    numel: int = 0
    """Trainable elements in the group on one rank, padding excluded."""

    def ranks_of(self, global_rank: int, world_size: int) -> tuple[int, ...]:
        e = self.expert_parallel_size
        return tuple(range(global_rank % e, world_size, e))


@dataclass(frozen=True)
class Execution:
    """How a strategy's runtime issues the backward collectives against compute.

    The plan says *what* is communicated; this says *when*, which is what decides how
    much communication hides behind backward (`evenzero.cost.timeline` simulates it).
    The defaults are evenzero's runtime (`ZeroConfig` defaults)."""

    max_in_flight: int | None = 2
    """Buckets whose reductions may be outstanding while backward compute goes on. When
    a bucket is ready and this many are outstanding, compute waits for the oldest. 0:
    each bucket's reduction blocks compute (DeepSpeed ZeRO-2 without `overlap_comm`);
    None: no limit (DDP, Megatron: asynchronous calls queue on one stream)."""
    launch_in_order: bool = True
    """True: a complete bucket waits until every bucket before it in plan order has been
    launched (evenzero's reducer, DDP's Reducer). False: each launches when complete."""
    copies_grads: bool = True
    """True: gradients are copied into a communication buffer when the bucket launches
    (evenzero stage 2, DeepSpeed's IPG buffer, FSDP2's `_chunk_cat`); False: they are
    accumulated in place in the buffer (DDP bucket views, Megatron's grad buffer)."""
    missing_grads_hold_bucket: bool = True
    """True: a bucket holding a parameter that produces no gradient is reduced only by
    the end-of-backward flush. False: such parameters do not hold it back (DDP's
    find_unused_parameters marks them ready; FSDP2 reduces the gradients it has)."""
    overlap_param_gather: bool = False
    """True: the step's all-gathers run in the next forward, each before the compute
    that needs it (FSDP2; evenzero's `ZeroConfig.overlap_param_gather`, Megatron's
    option of the same name). False: the step waits for them."""

    def __post_init__(self) -> None:
        m = self.max_in_flight
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 0):
            raise PlanError(f"max_in_flight must be None or a non-negative integer, got {m!r}")


@dataclass(frozen=True)
class Plan:
    """A strategy's complete plan for one model on one world size."""

    strategy: str
    world_size: int
    groups: tuple[GroupInfo, ...]
    buckets: tuple[Bucket, ...]
    """Communication buckets, in the order their backward collectives are issued."""
    layouts: tuple[Layout, ...]
    """Ownership layouts: rank r of a group owns the r-th equal slice of each one."""
    collectives: tuple[Collective, ...]
    arrival: tuple[str, ...] = ()
    """The gradient-arrival order the plan was made for."""
    notes: tuple[str, ...] = ()
    """Human-readable remarks (fallbacks taken, knobs used)."""
    sharded: bool = True
    """False for strategies that keep full optimizer state on every rank (DDP)."""
    execution: Execution = Execution()
    """When the collectives are issued against compute (for timeline predictions)."""
    bucket_numel: int | None = None
    """The bucket size (elements) the buckets were cut with, where the strategy cuts by
    one (evenzero: the fixed size, or the one "auto" chose); None otherwise."""

    def group(self, name: str) -> GroupInfo:
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(f"plan has no group {name!r}; groups are {[g.name for g in self.groups]}")

    def backward(self) -> Schedule:
        """The backward collectives in issue order (prints as a table)."""
        return Schedule(c for c in self.collectives if c.phase == BACKWARD)

    def step(self) -> Schedule:
        """The step's collectives in issue order (prints as a table)."""
        return Schedule(c for c in self.collectives if c.phase == STEP)

    def group_layouts(self, group: str) -> tuple[Layout, ...]:
        return tuple(sorted((b for b in self.layouts if b.group == group), key=lambda b: b.index))

    def group_buckets(self, group: str) -> tuple[Bucket, ...]:
        return tuple(b for b in self.buckets if b.group == group)

    def layout_shards(self, group: str) -> tuple[LayoutShard, ...]:
        """Each layout's slice in a rank's flat shard of `group`: the shard is the
        concatenation, in layout index order, of the rank's equal slice of every layout."""
        n = self.group(group).size
        out, base = [], 0
        for layout in self.group_layouts(group):
            out.append(LayoutShard(layout.index, base, layout.numel // n))
            base += layout.numel // n
        return tuple(out)

    def shard_numel(self, group: str) -> int:
        """Elements in each rank's flat shard of `group` (equal on every rank)."""
        return sum(s.numel for s in self.layout_shards(group))

    def padding(self) -> int:
        return sum(b.padding for b in self.layouts)

    def shard_ranges(self, group: str, rank: int) -> tuple[ShardRange, ...]:
        """The runs of parameters that group-local `rank` owns, in shard order."""
        n = self.group(group).size
        if not 0 <= rank < n:
            raise ValueError(f"rank {rank} is outside group {group!r} of size {n}")
        out: list[ShardRange] = []
        for layout, shard in zip(self.group_layouts(group), self.layout_shards(group),
                                 strict=True):
            lo, hi = rank * shard.numel, (rank + 1) * shard.numel
            for slot in layout.params:
                if slot.offset >= hi:
                    break
                a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
                if a < b:
                    out.append(ShardRange(slot.name, rank, a - slot.offset, b - a,
                                          layout.index, a, shard.shard_offset + a - lo))
        return tuple(out)

    @cached_property
    def _owner_index(self) -> dict[str, tuple[str, int, int]]:
        return {s.name: (b.group, b.index, s.offset) for b in self.layouts for s in b.params}

    def locate(self, param: str) -> tuple[str, int, int]:
        """(group, layout index, offset in layout) of a parameter."""
        return self._owner_index[param]


def align_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple
