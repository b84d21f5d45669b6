"""The predicted cost of a whole plan: each collective priced by a `CostModel`."""

from __future__ import annotations

from dataclasses import dataclass

from evenzero.cost.memory import MemoryEstimate, estimate_memory
from evenzero.cost.model import CostModel, bytes_sent_per_rank
from evenzero.plan import BACKWARD, STEP, Collective, Plan


@dataclass(frozen=True)
class CollectiveCost:
    """The predicted cost of one planned collective."""

    collective: Collective
    """The call."""
    seconds: float
    """Predicted time of the call."""
    variant: str
    """Variant charged ("" for a one-rank group)."""
    bytes_sent: float
    """Bytes one participating rank sends."""


@dataclass(frozen=True)
class PlanCost:
    """Predicted communication cost of one plan on one cost model."""

    strategy: str
    """The plan's strategy."""
    cost_model: str
    """Name of the cost model used."""
    calls: tuple[CollectiveCost, ...]
    """Every collective of the plan, in plan order, with its cost."""
    memory: MemoryEstimate
    """Gradient and optimizer memory per rank (see `evenzero.cost.memory`)."""

    def _phase(self, phase: str) -> tuple[CollectiveCost, ...]:
        return tuple(c for c in self.calls if c.collective.phase == phase)

    @property
    def backward(self) -> tuple[CollectiveCost, ...]:
        return self._phase(BACKWARD)

    @property
    def step(self) -> tuple[CollectiveCost, ...]:
        return self._phase(STEP)

    @property
    def backward_seconds(self) -> float:
        """Backward collectives issued serially on one stream, each paying its alpha."""
        return sum(c.seconds for c in self.backward)

    @property
    def step_seconds(self) -> float:
        return sum(c.seconds for c in self.step)

    @property
    def backward_bytes_per_rank(self) -> float:
        return sum(c.bytes_sent for c in self.backward)

    @property
    def step_bytes_per_rank(self) -> float:
        return sum(c.bytes_sent for c in self.step)

    @property
    def bytes_per_rank(self) -> float:
        """Bytes one rank sends per optimizer step (backward + step collectives)."""
        return self.backward_bytes_per_rank + self.step_bytes_per_rank


def predict(plan: Plan, model: CostModel, bucket_numel: int | None = None) -> PlanCost:
    """Cost every collective of `plan` on `model`, and estimate its memory per rank.

    `bucket_numel` is the bucket size the plan was made with, if the user chose one
    (DeepSpeed's IPG buffer has that size whatever the model).

    Every rank takes part in each listed collective once (an expert group's call runs on
    all its expert-data-parallel groups at the same time), so per-call bytes are per rank."""
    calls = []
    for c in plan.collectives:
        variant, seconds = model.choose(c.op, c.group_size, c.nbytes)
        calls.append(CollectiveCost(c, seconds, variant.name if variant else "",
                                    bytes_sent_per_rank(c.op, c.group_size, c.nbytes)))
    return PlanCost(plan.strategy, model.name, tuple(calls), estimate_memory(plan, bucket_numel))
