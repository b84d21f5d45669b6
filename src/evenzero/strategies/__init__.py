"""Planners: each turns a `ModelSpec`, a world size and `PlanOptions` into a `Plan`.

`plan(spec, world_size, "evenzero")` is the entry point; `STRATEGIES` lists them all.
"""

from __future__ import annotations

from collections.abc import Callable

from evenzero.plan import Plan, PlanError
from evenzero.spec import ModelSpec
from evenzero.strategies.common import PlanOptions, group_infos

Planner = Callable[[ModelSpec, int, PlanOptions], Plan]


def _registry() -> dict[str, Planner]:
    from evenzero.strategies import ddp, deepspeed, evenzero, fsdp2, megatron

    return {
        "evenzero": evenzero.plan_evenzero,
        "deepspeed-0.6": deepspeed.plan_deepspeed_reduce,
        "deepspeed": deepspeed.plan_deepspeed_allreduce,
        "deepspeed-reduce-mode": deepspeed.plan_deepspeed_reduce_mode,
        "megatron": megatron.plan_megatron,
        "fsdp2": fsdp2.plan_fsdp2,
        "ddp": ddp.plan_ddp,
    }


STRATEGY_NAMES = ("evenzero", "deepspeed-0.6", "deepspeed", "megatron", "fsdp2", "ddp")
"""The strategies `evenzero plan ... --strategy all` compares. "deepspeed-reduce-mode"
(DeepSpeed 0.12.4+ with use_multi_rank_bucket_allreduce=false) is planned on request."""


def strategy_names() -> tuple[str, ...]:
    """Every strategy `plan` accepts (STRATEGY_NAMES plus those planned on request)."""
    return tuple(_registry())


def plan(spec: ModelSpec, world_size: int, strategy: str = "evenzero",
         options: PlanOptions | None = None) -> Plan:
    """Plan `spec` on `world_size` ranks with `strategy`."""
    planners = _registry()
    if strategy not in planners:
        raise PlanError(f"unknown strategy {strategy!r}; choose from {', '.join(planners)}")
    return planners[strategy](spec, world_size, options or PlanOptions())


__all__ = ["STRATEGY_NAMES", "PlanOptions", "group_infos", "plan", "strategy_names"]
