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


GIB = 1 << 30


@dataclass(frozen=True)
class OffloadVerdict:
    """`evenzero plan --offload`: evenzero's plan with and without `offload_optimizer`."""

    device_gib: float
    """The device memory each rank has (`--device-memory-gib`)."""
    plain_device_bytes: int
    """Parameters + gradients + in-flight buckets + optimizer on the device, no offload."""
    offload_device_bytes: int
    """The same with offload (parameters + buckets)."""
    offload_host_bytes: int
    """What offload holds in host memory instead, per rank."""
    plain_step_s: float | None
    """Predicted step (timeline) without and with offload; None without compute figures."""
    offload_step_s: float | None
    link_bytes: int
    """Bytes across the host link per step (gradients down, parameters back and up)."""

    @property
    def plain_fits(self) -> bool:
        return self.plain_device_bytes <= self.device_gib * GIB

    @property
    def offload_fits(self) -> bool:
        return self.offload_device_bytes <= self.device_gib * GIB

    def lines(self) -> list[str]:
        def gib(n: int) -> str:
            return f"{n / GIB:.2f} GiB"

        def fit(ok: bool) -> str:
            return "fits" if ok else "does not fit"

        out = [f"offload_optimizer='cpu' (evenzero, per rank; activations not counted, "
               f"device {self.device_gib:g} GiB):",
               f"  plain ZeRO: {gib(self.plain_device_bytes)} on the device: "
               f"{fit(self.plain_fits)}",
               f"  offload:    {gib(self.offload_device_bytes)} on the device "
               f"({fit(self.offload_fits)}), {gib(self.offload_host_bytes)} in host memory, "
               f"{gib(self.link_bytes)} across the host link per step"]
        if self.plain_step_s is not None and self.offload_step_s is not None:
            out.append(f"  predicted step: {self.plain_step_s * 1e3:.1f} ms plain, "
                       f"{self.offload_step_s * 1e3:.1f} ms with offload "
                       f"({self.offload_step_s / self.plain_step_s:.2f}x)")
        if self.offload_fits and not self.plain_fits:
            out.append("  verdict: offload fits where plain ZeRO does not")
        elif self.plain_fits:
            out.append("  verdict: plain ZeRO fits; offload only trades step time for memory")
        else:
            out.append("  verdict: neither fits; use more ranks")
        return out


def offload_verdict(plain: Plan, offloaded: Plan, device_gib: float,
                    plain_step_s: float | None, offload_step_s: float | None) -> OffloadVerdict:
    from evenzero.cost.memory import estimate_memory
    from evenzero.spec import DTYPE_BYTES

    params = sum(g.numel * DTYPE_BYTES[g.dtype] for g in plain.groups)
    a, b = estimate_memory(plain), estimate_memory(offloaded)
    work = offloaded.step_work
    link = (work.host_link_bytes + work.host_link_backward_bytes) if work is not None else 0
    return OffloadVerdict(device_gib, params + a.total_bytes, params + b.total_bytes,
                          b.host_bytes, plain_step_s, offload_step_s, link)
