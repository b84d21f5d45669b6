"""evenzero: ZeRO-1/2 data parallelism with one equal reduce-scatter per bucket."""

from __future__ import annotations

__version__ = "0.1.0"

from evenzero.plan import (  # noqa: E402
    Bucket,
    Collective,
    FlatBuffer,
    Layout,
    Plan,
    PlanError,
    Schedule,
    ShardRange,
    Slot,
)
from evenzero.spec import ModelSpec, ParamSpec, SpecError  # noqa: E402
from evenzero.strategies import PlanOptions, plan  # noqa: E402


def __getattr__(name: str):
    # The runtime and the rendezvous need torch.distributed; keep `import evenzero` light
    # for the planner.
    if name == "ZeroOptimizer":
        from evenzero.runtime.optimizer import ZeroOptimizer

        return ZeroOptimizer
    if name in ("init_process_group", "RendezvousError"):
        from evenzero import rendezvous

        return getattr(rendezvous, name)
    raise AttributeError(name)


__all__ = ["Bucket", "Collective", "FlatBuffer", "Layout", "ModelSpec", "ParamSpec", "Plan",
           "PlanError", "PlanOptions", "RendezvousError", "Schedule", "ShardRange", "SpecError",
           "Slot", "ZeroOptimizer", "init_process_group", "plan"]
