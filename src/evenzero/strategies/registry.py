"""The strategy registry: one `Strategy` record per planner, registered once.

Everything that depends on which system a plan models reads a field of its record: the
CLI's `--strategy all` list (`compared`), the memory model (`memory`, in
`evenzero.cost.memory`), whether `ZeroOptimizer` can run it (`sharded`). Nothing switches
on strategy names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from evenzero.plan import Plan
from evenzero.spec import ModelSpec
from evenzero.strategies import ddp, deepspeed, evenzero, fsdp2, megatron
from evenzero.strategies.common import PlanOptions

Planner = Callable[[ModelSpec, int, PlanOptions], Plan]


class GradsAtRest(Enum):
    """What gradient memory a rank holds between backward and step."""

    FP32_SHARD = "fp32 grad shard"
    """An fp32 shard of 1/N of every layout (padding included)."""
    MESSAGE_SHARD = "partition grads"
    """This rank's partition of the gradients, in the message dtype."""
    PADDED_BUFFER = "full padded grad buffer"
    """The whole padded gradient buffer, in the message dtype, on every rank."""
    FULL = "full grads (bucket views)"
    """Every gradient, in the message dtype, on every rank."""


@dataclass(frozen=True)
class MemoryModel:
    """How a strategy's gradient and communication memory scales (`cost.memory` reads it)."""

    grads_at_rest: GradsAtRest
    """Gradient memory held between backward and step."""
    buckets_in_flight: int = 0
    """Buffers of the largest bucket alive during backward, in the message dtype."""
    reserved_buffer_numel: int | None = None
    """A communication buffer of this many elements (or of the user's bucket size)
    allocated whatever the model: DeepSpeed's IPG buffer."""
    in_flight_basis: str = ""
    """How the in-flight memory is described in the estimate's basis line."""


@dataclass(frozen=True)
class Strategy:
    """One planner and the facts about the system it models."""

    name: str
    """The name `plan()` and `ZeroConfig.strategy` accept."""
    planner: Planner
    """`(spec, world_size, options) -> Plan`."""
    memory: MemoryModel
    """Gradient and communication memory per rank."""
    notes: str
    """One line: which system and version the plan models."""
    sharded: bool = True
    """Optimizer state is sharded (False: every rank holds all of it, as DDP)."""
    compared: bool = True
    """Part of `evenzero plan --strategy all`."""
    tunes_bucket_size: bool = False
    """Its bucket size may be refined at run time from measured backwards
    (`ZeroConfig.bucket_numel="auto"`; `runtime/autotune.py`)."""

    def plan(self, spec: ModelSpec, world_size: int, options: PlanOptions | None = None) -> Plan:
        return self.planner(spec, world_size, options or PlanOptions())


_DEEPSPEED_MEMORY = MemoryModel(
    GradsAtRest.MESSAGE_SHARD, reserved_buffer_numel=deepspeed.DEFAULT_REDUCE_BUCKET_SIZE,
    in_flight_basis="IPG buffer of {reserved:,} elements")

REGISTRY: tuple[Strategy, ...] = (
    Strategy("evenzero", evenzero.plan_evenzero,
             MemoryModel(GradsAtRest.FP32_SHARD, buckets_in_flight=2,
                         in_flight_basis="2 buckets in flight"),
             "arrival-ordered layout, one equal reduce-scatter per bucket",
             tunes_bucket_size=True),
    Strategy("deepspeed-0.6", deepspeed.plan_deepspeed_reduce, _DEEPSPEED_MEMORY,
             "DeepSpeed ZeRO-2 v0.6 - v0.12.3: one reduce per (destination, adjacent run)"),
    Strategy("deepspeed", deepspeed.plan_deepspeed_allreduce, _DEEPSPEED_MEMORY,
             "DeepSpeed ZeRO-2 v0.12.4+: one all-reduce per process group per bucket"),
    Strategy("deepspeed-reduce-mode", deepspeed.plan_deepspeed_reduce_mode, _DEEPSPEED_MEMORY,
             "DeepSpeed ZeRO-2 v0.12.4+ with use_multi_rank_bucket_allreduce=false",
             compared=False),
    Strategy("megatron", megatron.plan_megatron,
             MemoryModel(GradsAtRest.PADDED_BUFFER),
             "Megatron-core DDP with the distributed optimizer"),
    Strategy("fsdp2", fsdp2.plan_fsdp2,
             MemoryModel(GradsAtRest.FP32_SHARD, buckets_in_flight=1,
                         in_flight_basis="one unit's RS input"),
             "PyTorch FSDP2, fully_shard(reshard_after_forward=False) per block"),
    Strategy("ddp", ddp.plan_ddp, MemoryModel(GradsAtRest.FULL),
             "PyTorch DDP: one all-reduce per bucket, full optimizer state", sharded=False),
)

STRATEGIES: dict[str, Strategy] = {s.name: s for s in REGISTRY}
"""Every registered strategy by name, in registration order."""

GENERIC_MEMORY = MemoryModel(GradsAtRest.MESSAGE_SHARD, buckets_in_flight=1,
                             in_flight_basis="one bucket in flight")
"""The memory model of a plan from an unregistered planner (a custom callable)."""
