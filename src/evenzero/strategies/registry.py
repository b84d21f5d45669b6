"""The strategy registry: one `Strategy` record per planner, registered once.

What depends on which system a plan models is either in the plan itself (its
`Execution`, `MemoryModel`, `StepWork` and `sharded`, set by the planner) or a field of
its record here: the CLI's `--strategy all` list (`compared`), whether the runtime may
refine its bucket size (`tunes_bucket_size`). Nothing switches on strategy names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from evenzero.plan import Plan
from evenzero.spec import ModelSpec
from evenzero.strategies import ddp, deepspeed, evenzero, fsdp2, megatron
from evenzero.strategies.common import PlanOptions

Planner = Callable[[ModelSpec, int, PlanOptions], Plan]


@dataclass(frozen=True)
class Strategy:
    """One planner and the facts about the system it models that are not in its plans."""

    name: str
    """The name `plan()` and `ZeroConfig.strategy` accept."""
    planner: Planner
    """`(spec, world_size, options) -> Plan`."""
    notes: str
    """One line: which system and version the plan models."""
    compared: bool = True
    """Part of `evenzero plan --strategy all`."""
    tunes_bucket_size: bool = False
    """Its bucket size may be refined at run time from measured backwards
    (`ZeroConfig.bucket_numel="auto"`; `runtime/autotune.py`)."""

    def plan(self, spec: ModelSpec, world_size: int, options: PlanOptions | None = None) -> Plan:
        return self.planner(spec, world_size, options or PlanOptions())


REGISTRY: tuple[Strategy, ...] = (
    Strategy("evenzero", evenzero.plan_evenzero,
             "arrival-ordered layout, one equal reduce-scatter per bucket",
             tunes_bucket_size=True),
    Strategy("deepspeed-0.6", deepspeed.plan_deepspeed_reduce,
             "DeepSpeed ZeRO-2 v0.6 - v0.12.3: one reduce per (destination, adjacent run)"),
    Strategy("deepspeed", deepspeed.plan_deepspeed_allreduce,
             "DeepSpeed ZeRO-2 v0.12.4+: one all-reduce per process group per bucket"),
    Strategy("deepspeed-reduce-mode", deepspeed.plan_deepspeed_reduce_mode,
             "DeepSpeed ZeRO-2 v0.12.4+ with use_multi_rank_bucket_allreduce=false",
             compared=False),
    Strategy("megatron", megatron.plan_megatron,
             "Megatron-core DDP with the distributed optimizer"),
    Strategy("fsdp2", fsdp2.plan_fsdp2,
             "PyTorch FSDP2, fully_shard(reshard_after_forward=False) per block"),
    Strategy("ddp", ddp.plan_ddp,
             "PyTorch DDP: one all-reduce per bucket, full optimizer state"),
)

STRATEGIES: dict[str, Strategy] = {s.name: s for s in REGISTRY}
"""Every registered strategy by name, in registration order."""
