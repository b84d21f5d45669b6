"""Planners: each turns a `ModelSpec`, a world size and `PlanOptions` into a `Plan`.

`plan(spec, world_size, "evenzero")` is the entry point. Every strategy is one `Strategy`
record in `registry.REGISTRY`; `STRATEGIES` maps names to records, and
`executable_plan` gives the runtime a plan it can execute without knowing which
planner made it; `choose_bucket` is evenzero's bucket-size choice, which the runtime
repeats with measured figures.
"""

from __future__ import annotations

from evenzero.plan import Plan, PlanError
from evenzero.spec import ModelSpec
from evenzero.strategies.common import AUTO, PlanOptions, group_infos
from evenzero.strategies.evenzero import choose_bucket
from evenzero.strategies.executable import PlannerArg, executable_plan, split_by_group
from evenzero.strategies.registry import REGISTRY, STRATEGIES, Planner, Strategy

STRATEGY_NAMES = tuple(s.name for s in REGISTRY if s.compared)
"""The strategies `evenzero plan ... --strategy all` compares; the others
("deepspeed-reduce-mode") are planned on request."""


def strategy_names() -> tuple[str, ...]:
    """Every strategy `plan` accepts (STRATEGY_NAMES plus those planned on request)."""
    return tuple(STRATEGIES)


def get_strategy(name: str) -> Strategy:
    """The registered strategy `name`; the error lists the choices."""
    if name not in STRATEGIES:
        raise PlanError(f"unknown strategy {name!r}; choose from {', '.join(STRATEGIES)}")
    return STRATEGIES[name]


def plan(spec: ModelSpec, world_size: int, strategy: str = "evenzero",
         options: PlanOptions | None = None) -> Plan:
    """Plan `spec` on `world_size` ranks with `strategy`."""
    return get_strategy(strategy).plan(spec, world_size, options)


__all__ = ["AUTO", "REGISTRY", "STRATEGIES", "STRATEGY_NAMES", "PlanOptions", "Planner",
           "PlannerArg", "Strategy", "choose_bucket", "executable_plan", "get_strategy",
           "group_infos", "plan", "split_by_group", "strategy_names"]
