"""`bucket_numel="auto"`: the bucket size with the shortest predicted step.

Small buckets start reducing early and hide behind backward, but every call pays a
latency and the calls queue behind each other; one bucket per group pays the fewest
latencies but nothing overlaps, and its whole reduction is exposed after backward. The
timeline (`evenzero.cost.timeline`) weighs both for the model, cost model and compute
at hand, so the choice is made by simulating each candidate:

* candidates: powers of two from 64K elements up to the first one that holds the largest
  group whole, and that group's size itself (one bucket per group). A parameter is
  never split, so several sizes can cut the same buckets; the smallest stands for them.
* each candidate is simulated twice: on the cost model, and with every collective
  `STRESS` times slower. Calibration times collectives on an otherwise idle group;
  during backward they share the host's cores (gloo on CPU) or the memory system with
  compute and run slower, and a large last bucket, whose reduction is exposed after
  backward, pays for that in full. A size that wins only if communication is exactly as
  fast as calibrated is fragile (measured on CPU gloo: a 20M-parameter model predicted
  2% faster with 3 buckets than with 6 ran 25% slower);
* the winner, among candidates within the memory budget, has the smallest worst-case
  regret: its step relative to the best candidate's, under either model. Regrets
  within 0.5% of each other count as a tie, which goes to fewer buckets (fewer
  latencies to mispredict).

Memory budget. Stage 2 keeps 1/N of the gradients at rest; the rest of its gradient
memory is the bucket buffers in flight, min(max_buckets_in_flight, buckets) times the
largest bucket (plus the reduce-scatter's scratch output: 1/N of that with NCCL, as much
again with gloo's all_to_all). Unbounded, a big bucket would quietly give back what
ZeRO-2 saves. By default they may take a quarter of the model's gradient bytes, what
DDP would hold, so stage 2 always keeps at least 3/4 of DDP's gradient memory off the
device, but never less than 64 MiB (below that the buffers are noise next to
activations, and small models often do best with one bucket) and never more than 1 GiB
(DeepSpeed's default reduce bucket, 5e8 elements, is about that in 16-bit types: no
evenzero default asks for more than a DeepSpeed user already budgets). Pass
`memory_budget` (or `PlanOptions.bucket_memory_bytes`) to change it.

`choose_bucket_numel` takes the planner's cut, `cut(numel) -> Plan`, so the choice knows
nothing of how a strategy lays out buckets: evenzero's planner passes its own
(`evenzero.strategies.evenzero.choose_bucket`, which the planner's default path and the
runtime's refinement after the first backwards both call, the latter with measured
compute and a measured cost model).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from evenzero.cost.compute import (
    ComputeProfile,
    DeviceCompute,
    estimate_profile,
    profile_from_times,
)
from evenzero.cost.model import OPS, CostModel
from evenzero.cost.presets import H100
from evenzero.cost.timeline import Timeline, simulate
from evenzero.plan import Plan
from evenzero.spec import DTYPE_BYTES, ModelSpec
from evenzero.wire import scratch_bytes

MIN_CANDIDATE = 2**16
"""Smallest bucket tried, in elements."""
BUDGET_FRACTION = 0.25
"""Default budget: this fraction of the model's gradient bytes..."""
BUDGET_FLOOR = 64 * 2**20
"""...but at least this many bytes..."""
BUDGET_CAP = 2**30
"""...and at most this many."""
TIE = 0.005
"""Relative difference in predicted step time below which two candidates tie."""
STRESS = 2.0
"""How much slower than calibrated communication may run while it overlaps compute."""


@dataclass(frozen=True)
class Candidate:
    """One bucket size tried."""

    numel: int
    """Bucket size in elements (the smallest that cuts these buckets)."""
    buckets: int
    """Buckets it cuts, over all groups."""
    step_s: float
    """Predicted step time."""
    stressed_s: float
    """Predicted step time with every collective `STRESS` times slower."""
    inflight_bytes: int
    """Bucket buffers in flight at most."""
    fits: bool
    """Within the memory budget."""


@dataclass(frozen=True)
class BucketChoice:
    """The chosen size, the plan it makes, and why."""

    numel: int
    """Chosen bucket size, in elements."""
    plan: Plan
    """The plan the cut makes with that size."""
    timeline: Timeline
    """Its predicted step."""
    budget_bytes: int
    """The memory budget applied."""
    candidates: tuple[Candidate, ...]
    """Everything tried, smallest size first."""
    note: str
    """One line for `Plan.notes`."""


def gradient_bytes(spec: ModelSpec, reduce_dtype: str | None = None) -> int:
    """The model's full gradient in its message dtype (what DDP holds)."""
    return sum(p.numel * (DTYPE_BYTES[reduce_dtype] if reduce_dtype else p.itemsize)
               for p in spec.params)


def default_memory_budget(spec: ModelSpec, reduce_dtype: str | None = None) -> int:
    """Bytes the in-flight bucket buffers may take by default (module docstring)."""
    share = BUDGET_FRACTION * gradient_bytes(spec, reduce_dtype)
    return int(min(BUDGET_CAP, max(BUDGET_FLOOR, share)))


def inflight_bytes(plan: Plan, max_in_flight: int | None = None) -> int:
    """Bucket input buffers the runtime's pool holds at most: one per bucket in flight
    (`max_in_flight`, default the plan's `Execution.max_in_flight`: None there means no
    limit, 0 one bucket at a time), each the size of the largest (an evenzero bucket is
    one reduce-scatter), each with its compressed send and receive buffers, if any."""
    sizes = [c.numel * c.itemsize + scratch_bytes(c.compression, c.numel, c.itemsize,
                                                  c.block_numel or 1)
             for c in plan.backward()]
    limit = plan.execution.max_in_flight if max_in_flight is None else max_in_flight
    held = len(sizes) if limit is None else min(max(limit, 1), len(sizes))
    return held * max(sizes, default=0)


def candidate_sizes(spec: ModelSpec) -> list[int]:
    """Powers of two from MIN_CANDIDATE until one holds the largest group, and that group."""
    largest = max(sum(p.numel for p in spec.group_params(g.name)) for g in spec.groups)
    sizes, n = [], MIN_CANDIDATE
    while n < largest:
        sizes.append(n)
        n *= 2
    return sorted({*sizes, max(1, largest)})


def device_or_default(cost: CostModel) -> DeviceCompute:
    """The cost model's compute figures; a model without them (a calibration saved before
    they were measured) gets the H100's, and the choice's note names them."""
    return cost.compute or H100


def as_profile(spec: ModelSpec, device: DeviceCompute,
               compute: ComputeProfile | Mapping[str, float] | None) -> ComputeProfile:
    """Measured times as they came, `{param: seconds}` in the spec's order, or FLOPs."""
    if isinstance(compute, ComputeProfile):
        return compute
    if compute is not None:
        return profile_from_times(spec, compute)
    return estimate_profile(spec, device)


Cut = Callable[[int], Plan]
"""A planner with everything but the bucket size fixed: `cut(numel)` is its plan with
buckets of at most `numel` elements."""


def choose_bucket_numel(spec: ModelSpec, cost_model: CostModel, cut: Cut,
                        compute: ComputeProfile | Mapping[str, float] | None = None,
                        memory_budget: int | None = None,
                        reduce_dtype: str | None = None) -> BucketChoice:
    """The bucket size whose plan has the shortest predicted step within `memory_budget`.

    Args:
        spec: the model (its arrival order is the one the plans are made for).
        cost_model: collective costs, with compute figures (`CostModel.compute`) unless
            `compute` gives measured times.
        cut: the planner, `cut(numel) -> Plan`; its plans' `Execution` says how many
            buckets are in flight at once.
        compute: a `ComputeProfile` (e.g. `profile_from_arrivals` of the first
            backwards), `{param_name: seconds}`, or None for FLOPs estimates.
        memory_budget: bytes the in-flight bucket buffers may take; None: the default.
        reduce_dtype: the message dtype, for the default budget (None: the parameters').

    Every rank that calls it with the same arguments gets the same answer (pure).
    """
    device = device_or_default(cost_model)
    profile = as_profile(spec, device, compute)
    budget = memory_budget or default_memory_budget(spec, reduce_dtype)
    stressed_model = slower_communication(cost_model, STRESS)
    tried: dict[tuple, tuple[Candidate, Plan, Timeline]] = {}
    for numel in candidate_sizes(spec):
        plan = cut(numel)
        key = tuple((b.group, b.numel) for b in plan.buckets)
        if key in tried:
            continue
        timeline = simulate(plan, cost_model, profile, device=device)
        stressed = simulate(plan, stressed_model, profile, device=device).total_s
        held = inflight_bytes(plan)
        tried[key] = (Candidate(numel, len(plan.buckets), timeline.total_s, stressed, held,
                                held <= budget), plan, timeline)
    entries = list(tried.values())
    fitting = [e for e in entries if e[0].fits]
    if fitting:
        best = min(e[0].step_s for e in fitting)
        best_stressed = min(e[0].stressed_s for e in fitting)

        def regret(c: Candidate) -> float:
            return max(_ratio(c.step_s, best), _ratio(c.stressed_s, best_stressed))

        least = min(regret(e[0]) for e in fitting)
        pick = min((e for e in fitting if regret(e[0]) <= least + TIE),
                   key=lambda e: (e[0].buckets, regret(e[0])))
    else:  # one parameter alone is over the budget: the least memory there is
        pick = min(entries, key=lambda e: (e[0].inflight_bytes, e[0].step_s))
    chosen, plan, timeline = pick
    return BucketChoice(chosen.numel, plan, timeline, budget, tuple(e[0] for e in entries),
                        _note(chosen, entries, budget, cost_model, profile, bool(fitting)))


def _ratio(value: float, best: float) -> float:
    """`value / best`, where a step predicted to take no time at all (an empty model) is
    as good as the best."""
    return value / best if best > 0 else (1.0 if value <= 0 else float("inf"))


def slower_communication(cost: CostModel, factor: float) -> CostModel:
    """`cost` with every collective `factor` times slower (latency and bandwidth)."""
    ops = {}
    for op in OPS:
        spec = getattr(cost, op)
        ops[op] = replace(spec, variants=tuple(
            replace(v, alpha_us=v.alpha_us * factor, step_us=v.step_us * factor,
                    busbw_gbs=v.busbw_gbs / factor)
            for v in spec.variants))
    return replace(cost, base_us=cost.base_us * factor, intra_step_us=cost.intra_step_us * factor,
                   inter_step_us=cost.inter_step_us * factor, **ops)


def _note(chosen: Candidate, entries, budget: int, cost: CostModel, profile: ComputeProfile,
          fits: bool) -> str:
    single = max(entries, key=lambda e: e[0].numel)[0]
    versus = (f"; one bucket per group: {single.step_s * 1e3:,.2f} ms"
              if single.numel != chosen.numel else "")
    memory = (f"in-flight buffers {_mib(chosen.inflight_bytes)} of a {_mib(budget)} budget"
              if fits else f"no size fits the {_mib(budget)} budget: least memory taken, "
                           f"{_mib(chosen.inflight_bytes)}")
    return (f"bucket_numel auto: {chosen.numel:,} elements ({chosen.buckets} bucket"
            f"{'' if chosen.buckets == 1 else 's'}), "
            f"predicted step {chosen.step_s * 1e3:,.2f} ms{versus}; {memory}; cost model "
            f"{cost.name}, compute: {profile.source}")


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


__all__ = ["BucketChoice", "Candidate", "Cut", "candidate_sizes", "choose_bucket_numel",
           "default_memory_budget", "gradient_bytes", "inflight_bytes", "slower_communication"]
