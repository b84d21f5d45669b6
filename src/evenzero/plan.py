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
from enum import Enum
from functools import cached_property

from evenzero.wire import wire_bytes


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
    """Bytes per element of the message as the bucket holds it (before compression)."""
    compression: str | None = None
    """How the message travels (`evenzero.wire`): None, exact values; "bf16" or "int8"
    (blockwise scales), sent by one all-to-all and summed in fp32 by the receiver."""
    block_numel: int = 0
    """Elements per int8 scale (`compression="int8"`); 0 otherwise."""
    algorithm: str = field(default="", compare=False)
    """How the runtime carried out the op (e.g. "all_to_all+sum"); not part of equality."""

    @property
    def bucket(self) -> int | None:
        """The bucket a backward collective reduces (None for step collectives)."""
        return self.buffer_index if self.phase == BACKWARD else None

    @property
    def nbytes(self) -> int:
        """Bytes of the message on the wire (compressed ones with their scales)."""
        return wire_bytes(self.compression, self.numel, self.itemsize, self.block_numel or 1)

    @property
    def wire(self) -> str:
        """Bytes per element on the wire, as `format_schedule` prints them: "4", "2 bf16",
        "1+4/256 int8"."""
        if self.compression == "int8":
            return f"1+4/{self.block_numel} int8"
        if self.compression:
            return f"{self.nbytes // max(1, self.numel)} {self.compression}"
        return str(self.itemsize)

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
    in it, elements (and segments), bytes per element on the wire (with the compression,
    if any) and, for a runtime trace, how the call was carried out."""
    head = ("#", "phase", "op", "group", "ranks", "root", "buffer", "offset", "elements",
            "bytes/el", "algorithm")
    rows = [head]
    for i, c in enumerate(calls):
        where = "-" if c.buffer_index is None else str(c.buffer_index)
        size = f"{c.numel:,}" + (f" in {len(c.segments)}" if c.segments else "")
        rows.append((str(i), c.phase, c.op, c.group, str(c.group_size),
                     "-" if c.root is None else str(c.root), where, f"{c.offset:,}", size,
                     c.wire, c.algorithm or "-"))
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
    dtype: str = field(default="float32", repr=False)
    """Dtype of the group's parameters (a name of `evenzero.spec.DTYPE_BYTES`). Not in
    the repr: `runtime.optstate.layout_fingerprint` hashes the repr of a plan's groups,
    and a rank state dict saved before this field existed must still load."""

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
    error_feedback: bool = False
    """True: each compressed send first adds the rank's quantization residual to the
    bucket and afterwards stores what the quantization lost (`evenzero.wire`), work the
    timeline charges beside the codec's."""

    def __post_init__(self) -> None:
        m = self.max_in_flight
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 0):
            raise PlanError(f"max_in_flight must be None or a non-negative integer, got {m!r}")


class GradsAtRest(Enum):
    """What gradient memory a rank holds between backward and step."""

    MASTER_SHARD = "fp32 grad shard"
    """A shard of 1/N of every layout (padding included), in the master dtype."""
    MESSAGE_SHARD = "partition grads"
    """This rank's partition of the gradients, in the message dtype."""
    PADDED_BUFFER = "full padded grad buffer"
    """The whole padded gradient buffer, in the message dtype, on every rank."""
    FULL = "full grads (bucket views)"
    """Every gradient, in the message dtype, on every rank."""
    BUFFERS_AND_SHARD = "full grad buffers + fp32 grad shard"
    """A persistent buffer per bucket in the parameter dtype (gradients land in it),
    and the master-dtype shard the reductions accumulate into (evenzero's stage 1)."""


@dataclass(frozen=True)
class MemoryModel:
    """How a plan's gradient, communication and optimizer memory scales, set by its
    planner (`evenzero.cost.memory.estimate_memory` turns it into bytes per rank)."""

    grads_at_rest: GradsAtRest
    """Gradient memory held between backward and step."""
    buckets_in_flight: int = 0
    """Buffers of the largest bucket alive during backward, in the message dtype."""
    reserved_buffer_numel: int | None = None
    """A communication buffer of this many elements allocated whatever the model
    (DeepSpeed's IPG buffer of `reduce_bucket_size`)."""
    in_flight_basis: str = ""
    """How the in-flight memory is described in the estimate's basis line."""
    master_itemsize: int = 4
    """Bytes of one master element; Adam's two states per element are of that dtype too."""
    aliased_groups: tuple[str, ...] = ()
    """Groups whose master is the parameters' own memory (evenzero: fp32 parameters with
    fp32 masters step the owned slice of the flat parameter buffer; DDP: the parameters
    themselves), so no separate master is held."""
    residual_numel: int = 0
    """Elements of error-feedback residual every rank holds (fp32, one per element of
    every compressed bucket, padding included); 0 without error feedback."""
    momentum_only_numel: int = 0
    """Elements of the busiest rank's shard whose optimizer keeps one state (Muon's
    momentum) instead of Adam's two; 0 for an element-wise optimizer."""
    offloaded: bool = False
    """The masters, the gradient shard and the optimizer state live in host memory
    (`offload_optimizer="cpu"`): the device holds the parameters and the buckets only."""

    def __post_init__(self) -> None:
        for name in ("buckets_in_flight", "master_itemsize", "residual_numel",
                     "momentum_only_numel"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise PlanError(f"{name} must be a non-negative integer, got {v!r}")


OPTIMIZER_IMPLS = ("single_tensor", "foreach", "fused")
"""torch.optim's implementations of an elementwise step (`StepWork.optimizer_impl`)."""
NORMS = ("fp32", "fp64")
"""Ways a step computes the global gradient norm (`StepWork.norm`)."""


@dataclass(frozen=True)
class StepWork:
    """The compute of one rank's optimizer step besides its collectives, as amounts of
    work; `evenzero.cost.compute.DeviceCompute` prices each kind on a device and the
    timeline charges them between backward and the parameter all-gathers."""

    optimizer_elements: int
    """Elements the optimizer updates on one rank: its shards, or every one (DDP)."""
    optimizer_impl: str | None = None
    """How torch.optim steps them: "single_tensor", "foreach" or "fused"; None: torch's
    default on the device (`DeviceCompute.default_optimizer_impl`)."""
    norm: str | None = None
    """The global gradient norm computed before the step: "fp32" (fp32 norms of chunks,
    combined in fp64), "fp64" (a copy of the gradients in fp64, then its norm); None:
    the step computes none."""
    norm_elements: int = 0
    """Gradient elements the norm reads on one rank."""
    copy_bytes: int = 0
    """Bytes read plus bytes written per step between the parameters and separate
    masters (picking up the user's writes, writing the update back); 0 where the master
    is the parameters' own memory (`MemoryModel.aliased_groups`)."""
    optimizer_tensor_numels: tuple[int, ...] = ()
    """Elements of each tensor the optimizer steps (one flat shard per group, or every
    parameter or its shard): a multi-pass implementation is cheaper per element on a
    tensor small enough for its passes to stay in the caches, and a single-tensor one
    pays `DeviceCompute.tensor_overhead_us` per tensor. Empty: one tensor."""
    params: int = 0
    """Parameters the step's own Python work visits once each (presence, the user's
    writes, state), each charged `DeviceCompute.param_overhead_us`."""
    matrix_flops: int = 0
    """FLOPs of the whole-tensor updates (Muon's Newton-Schulz iterations) on the busiest
    rank; 0 for an element-wise optimizer."""
    host_step: bool = False
    """The optimizer steps on the host (`offload_optimizer="cpu"`), priced by
    `DeviceCompute.host_step_seconds`."""
    host_link_bytes: int = 0
    """Bytes crossing the host link in the step: the parameters read back for the user's
    writes and the updated parameters copied to the device."""
    host_link_backward_bytes: int = 0
    """Bytes crossing the host link during the backward: the reduced gradient shard."""

    def __post_init__(self) -> None:
        if self.optimizer_impl not in (None, *OPTIMIZER_IMPLS):
            raise PlanError(f"optimizer implementation {self.optimizer_impl!r} is not one of "
                            f"{OPTIMIZER_IMPLS}")
        if self.norm not in (None, *NORMS):
            raise PlanError(f"norm {self.norm!r} is not one of {NORMS} or None")
        for name in ("optimizer_elements", "norm_elements", "copy_bytes", "params",
                     "matrix_flops", "host_link_bytes", "host_link_backward_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise PlanError(f"{name} must be a non-negative integer, got {v!r}")
        if self.optimizer_tensor_numels and sum(self.optimizer_tensor_numels) != self.optimizer_elements:
            raise PlanError(f"optimizer tensors hold {sum(self.optimizer_tensor_numels):,} "
                            f"elements, not the {self.optimizer_elements:,} the step updates")

    @property
    def optimizer_tensors(self) -> int:
        """Tensors the optimizer steps."""
        return len(self.optimizer_tensor_numels) or 1


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
    memory: MemoryModel | None = None
    """How its memory scales (`evenzero.cost.memory`); None: a planner that says nothing,
    estimated as one bucket in flight and a partition of gradients (`GENERIC_MEMORY`)."""
    step_work: StepWork | None = None
    """The optimizer step's compute (for timeline predictions); None: the optimizer on
    the rank's elements, torch's default implementation, nothing else."""

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
