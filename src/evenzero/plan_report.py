"""What `evenzero plan` reports about a plan: a summary, and the JSON records.

`collective_record` is the one JSON shape of a collective call, shared by
`evenzero plan --json` and anything that records collectives as they run.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from statistics import median
from typing import Any

from evenzero.cost import PlanCost
from evenzero.plan import Bucket, Collective, Plan


def collective_record(c: Collective) -> dict[str, Any]:
    """The JSON record of one collective call."""
    out: dict[str, Any] = {"phase": c.phase, "op": c.op, "group": c.group,
                           "group_size": c.group_size, "root": c.root, "bucket": c.buffer_index,
                           "offset": c.offset, "numel": c.numel, "itemsize": c.itemsize}
    if c.segments:
        out["segments"] = [list(s) for s in c.segments]
    if c.compression:
        out["compression"] = c.compression
        out["block_numel"] = c.block_numel
        out["wire_bytes"] = c.nbytes
    if c.algorithm:
        out["algorithm"] = c.algorithm
    return out


def bucket_record(b: Bucket) -> dict[str, Any]:
    """The JSON record of one communication bucket (numel includes padding)."""
    return {"group": b.group, "index": b.index, "numel": b.numel,
            "params": [{"name": s.name, "offset": s.offset, "numel": s.numel} for s in b.params]}


@dataclass(frozen=True)
class PlanSummary:
    """The numbers the comparison table shows for one plan."""

    strategy: str
    """Strategy name."""
    backward_ops: tuple[tuple[str, int], ...]
    """(op, count) of backward collectives, most frequent first."""
    message_bytes: tuple[int, int, int]
    """(min, median, max) backward message size in bytes; zeros if none."""
    padding: int
    """Padding elements in the ownership layouts."""
    padding_fraction: float
    """Padding as a fraction of the trainable elements."""
    cost: PlanCost
    """Predicted times, bytes and memory."""
    notes: tuple[str, ...]
    """The plan's own remarks."""

    @property
    def backward_calls(self) -> int:
        return sum(n for _, n in self.backward_ops)


def summarize(plan: Plan, cost: PlanCost) -> PlanSummary:
    backward = plan.backward()
    sizes = sorted(c.nbytes for c in backward)
    msg = (sizes[0], int(median(sizes)), sizes[-1]) if sizes else (0, 0, 0)
    ops = tuple(Counter(c.op for c in backward).most_common())
    used = sum(g.numel for g in plan.groups)
    pad = plan.padding()
    return PlanSummary(plan.strategy, ops, msg, pad, pad / used if used else 0.0, cost,
                       plan.notes)


def summary_record(s: PlanSummary) -> dict[str, Any]:
    m = s.cost.memory
    return {
        "backward_collectives": s.backward_calls,
        "backward_ops": dict(s.backward_ops),
        "step_collectives": len(s.cost.step),
        "message_bytes": dict(zip(("min", "median", "max"), s.message_bytes, strict=True)),
        "bytes_per_rank": round(s.cost.bytes_per_rank),
        "backward_bytes_per_rank": round(s.cost.backward_bytes_per_rank),
        "step_bytes_per_rank": round(s.cost.step_bytes_per_rank),
        "padding_elements": s.padding,
        "cost_model": s.cost.cost_model,
        "predicted_backward_s": s.cost.backward_seconds,
        "predicted_step_s": s.cost.step_seconds,
        "memory_per_rank": {"grad_bytes": m.grad_bytes, "inflight_bytes": m.inflight_bytes,
                            "optimizer_bytes": m.optimizer_bytes, "residual_bytes": m.residual_bytes,
                            "total_bytes": m.total_bytes,
                            "basis": m.basis},
        "notes": list(s.notes),
    }


def plan_record(plan: Plan, summary: PlanSummary) -> dict[str, Any]:
    """The JSON record of one plan: buckets, collectives and the summary."""
    return {"strategy": plan.strategy,
            "buckets": [bucket_record(b) for b in plan.buckets],
            "collectives": [collective_record(c) for c in plan.collectives],
            "summary": summary_record(summary)}


def plans_record(world_size: int, plans: list[tuple[Plan, PlanSummary]]) -> dict[str, Any]:
    """The top level of `evenzero plan --json`."""
    return {"world_size": world_size, "plans": [plan_record(p, s) for p, s in plans]}


__all__ = ["PlanSummary", "bucket_record", "collective_record", "plan_record", "plans_record",
           "summarize", "summary_record"]
