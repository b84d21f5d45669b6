"""The runtime's `bucket_numel="auto"`: the bucket size refined once, from this job.

At construction the bucket size is the planner's choice (`evenzero.strategies.choose_bucket`):
compute from FLOPs, collectives from a cost preset, both guesses about this machine.
After the measuring backwards (which reduce nothing until their end, so their hook
timestamps are pure compute) it is refined once, from what the job itself measures:

1. compute: the gradient hooks' timestamps (`ArrivalClock`) become a per-parameter
   `ComputeProfile` (`profile_from_arrivals`, from the gradient reaching the module's
   output to the end of backward); the first backward pays one-time costs
   (allocations, first calls), so when more than one was measured it is left out and
   the rest give a per-parameter median;
2. network: a quick calibration (`quick_cost_model`) of the process groups the plan
   reduces over: the runtime's own reduce-scatter and the step's all-gather at three
   sizes and its small all-reduce at two, fastest of `repeats` calls, slowest rank
   (`evenzero.calibration.sweep`); the copy bandwidth; on the CPU, how much a
   collective in flight slows compute; the seconds per element of the optimizer step
   when the runtime timed one;
3. the choice: `choose_bucket` with that profile and cost model (the planner's
   rule: the shortest predicted step within the memory budget).

Every rank takes part in the calibration (it is collective); rank 0 alone decides, from
its own measurements, and broadcasts the result (`agree_choice`), so every rank plans
the same buckets, as with the arrival order. A problem on rank 0 (timings no fit can
use, say) is broadcast too: every rank keeps the plan it has, and the note says why.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, replace
from time import perf_counter
from typing import Any

import torch
import torch.distributed as dist

from evenzero.calibration import sweep
from evenzero.cost import CostModel, CostModelError, OpCost, Sample, Variant, fit_op
from evenzero.cost.compute import DeviceCompute
from evenzero.runtime.backwardclock import BackwardTiming, measured_profile
from evenzero.runtime.collectives import broadcast
from evenzero.spec import ModelSpec
from evenzero.strategies import PlanOptions, choose_bucket

QUICK_SIZES = {"cpu": (2**12, 2**16, 2**20), "cuda": (2**16, 2**20, 2**24)}
"""Message sizes (elements) of the quick calibration, by device type: latency-bound to
bandwidth-bound on gloo (1M fp32 elements take milliseconds there); NCCL needs larger
messages to reach its bandwidth."""
QUICK_REPEATS = 2
"""Timed calls per op and size (after one warm-up call); the fastest counts."""
COPY_NUMEL = 2**22
"""Elements copied to time memory bandwidth (16 MiB of fp32)."""
NOTE_BYTES = 2048
"""Longest note rank 0 broadcasts (UTF-8 bytes)."""


# ---------------------------------------------------------------------- calibration


@dataclass(frozen=True)
class QuickCalibration:
    """How the quick calibration runs (bounded: a few sizes, a couple of calls)."""

    sizes: tuple[int, ...] | None = None
    """Message sizes in elements; None: `QUICK_SIZES` for the device type."""
    repeats: int = QUICK_REPEATS
    """Timed calls per op and size."""


@dataclass(frozen=True)
class CalibrationTarget:
    """What is calibrated: the groups the plan reduces over, as the runtime runs them."""

    groups: tuple[tuple[int, Any], ...]
    """(group size, this rank's process group of that size), world first; one per size."""
    device: torch.device
    """Where gradients live (and the messages are timed)."""
    dtype: torch.dtype
    """Message dtype (the reduce dtype of the largest group)."""
    rs_algorithm: str
    """The runtime's reduce-scatter ("all_to_all+sum" or "reduce_scatter_tensor")."""
    base: DeviceCompute
    """Compute figures not measured here (matmul throughput) come from this."""


def quick_cost_model(target: CalibrationTarget, name: str,
                     optimizer_seconds: tuple[float, int] | None = None,
                     how: QuickCalibration = QuickCalibration(),
                     optimizer_impl: str | None = None) -> CostModel:
    """Calibrate the target's groups; collective over every group in `target.groups`
    (every rank calls it with the same sizes). `optimizer_seconds` is (seconds, master
    elements) of an optimizer step the runtime timed, if any, with implementation
    `optimizer_impl` (None: the device's default)."""
    sizes = how.sizes or QUICK_SIZES["cuda" if target.device.type == "cuda" else "cpu"]
    samples: list[Sample] = []
    for _, group in target.groups:
        samples += sweep(group, sizes, ("reduce_scatter", "all_gather"), how.repeats,
                         target.dtype, device=target.device, rs_algorithm=target.rs_algorithm)
        samples += sweep(group, sizes[:2], ("all_reduce",), how.repeats, target.dtype,
                         device=target.device, rs_algorithm=target.rs_algorithm)
    compute = _quick_compute(target, sizes[-1], optimizer_seconds, optimizer_impl)
    world = target.groups[0][0]
    ops = {op: _op_cost(op, [s for s in samples if s.op == op], world,
                        target.rs_algorithm if op == "reduce_scatter" else "measured")
           for op in ("reduce_scatter", "all_gather", "all_reduce")}
    backend = str(dist.get_backend(target.groups[0][1]))
    return CostModel(name=name, description=f"{backend}, measured by the runtime on "
                                            f"{world} ranks ({target.device.type})",
                     all_reduce=ops["all_reduce"], reduce_scatter=ops["reduce_scatter"],
                     all_gather=ops["all_gather"], reduce=ops["all_reduce"],  # unused by evenzero
                     reference_ranks=world, gpus_per_node=world, compute=compute,
                     fitted_ranks=(world,),
                     sources=f"evenzero runtime quick calibration: sizes {list(sizes)} elements, "
                             f"fastest of {how.repeats} calls, slowest rank")


def _op_cost(op: str, samples: list[Sample], world: int, label: str) -> OpCost:
    """One variant per measured group size; the world's also prices any other size."""
    exact = []
    for n in sorted({s.group_size for s in samples}):
        v = _fit([s for s in samples if s.group_size == n], label)
        exact.append(replace(v, group_size=n))
    anchor = next(v for v in exact if v.group_size == world)
    return OpCost((*exact, replace(anchor, group_size=None)))


def _fit(samples: list[Sample], label: str) -> Variant:
    """`fit_op`, or where a few noisy timings refuse a line, the latency of the smallest
    message and the bandwidth between the smallest and the largest (flat if none)."""
    try:
        return fit_op(samples, label)
    except CostModelError:
        small = min(samples, key=lambda s: s.nbytes)
        large = max(samples, key=lambda s: s.nbytes)
        extra = large.seconds - small.seconds
        moved = large.nbytes - small.nbytes
        busbw = moved / extra / 1e9 if extra > 0 and moved > 0 else 1e6
        return Variant(label, max(small.seconds, 1e-9) * 1e6, busbw)


def _quick_compute(target: CalibrationTarget, message_numel: int,
                   optimizer_seconds: tuple[float, int] | None,
                   optimizer_impl: str | None = None) -> DeviceCompute:
    device = target.device
    src = torch.ones(COPY_NUMEL, device=device)
    dst = torch.empty_like(src)
    copy_s = _fastest(lambda: dst.copy_(src), device, 3)
    memory_gbs = 2 * COPY_NUMEL * src.element_size() / copy_s / 1e9
    slowdown = target.base.comm_slowdown
    if device.type == "cpu":
        slowdown = _comm_slowdown(target.groups[0][1], message_numel, target.dtype)
    compute = replace(target.base, name="measured by the runtime", memory_gbs=memory_gbs,
                      comm_slowdown=slowdown,
                      sources=f"runtime quick calibration: {COPY_NUMEL:,}-element copy, "
                              f"optimizer step timed by the runtime"
                              f"{'' if optimizer_seconds else ' (not yet: preset figure)'}, "
                              f"small matmuls beside an all-to-all; matmul throughput from "
                              f"{target.base.name}")
    if optimizer_seconds is not None and optimizer_seconds[1] > 0:
        # The figure of the implementation that ran (fused, foreach, ...), in this host's
        # copy bandwidth, so the timeline prices this job's step as it ran.
        per_element = optimizer_seconds[0] * memory_gbs * 1e9 / optimizer_seconds[1]
        compute = compute.with_optimizer_bytes(optimizer_impl, max(per_element, 1e-3))
    return compute


def _fastest(work, device: torch.device, repeats: int) -> float:
    work()
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t0 = perf_counter()
        work()
        _sync(device)
        best = min(best, perf_counter() - t0)
    return max(best, 1e-9)


def _comm_slowdown(group, numel: int, dtype: torch.dtype) -> float:
    """How much slower small matmuls run while a collective is in flight (gloo's threads
    share the cores with compute), as `evenzero.calibration.measure_compute` does,
    with one message instead of a timed loop."""
    # Its own generator: library code never draws from the user's random state.
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 256, generator=gen), torch.randn(256, 256, generator=gen)
    alone = 8 / _fastest(lambda: [torch.mm(a, b) for _ in range(8)], torch.device("cpu"), 2)
    n = dist.get_world_size(group)
    message = torch.ones(-(-numel // n) * n, dtype=dtype)
    out = torch.empty_like(message)
    dist.barrier(group=group)
    work = dist.all_to_all_single(out, message, group=group, async_op=True)
    calls, t0 = 0, perf_counter()
    while not work.is_completed():
        torch.mm(a, b)
        calls += 1
    elapsed = perf_counter() - t0
    work.wait()
    during = calls / elapsed if calls and elapsed > 0 else alone
    # Capped at 1 (compute at half speed): overlapping then costs what running the two
    # one after the other costs, which is what sharing the same cores can do at worst;
    # higher readings of a measurement this short are noise, and would make the choice
    # avoid overlap that pays.
    return min(1.0, max(0.0, alone / during - 1))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------- the choice


@dataclass(frozen=True)
class RefinedBucket:
    """The outcome every rank agreed on."""

    numel: int | None
    """The bucket size rank 0 chose; None: not refined (the plan in place stands)."""
    note: str
    """One line for `Plan.notes`: what was chosen and why, or why nothing was."""
    seconds: float
    """Wall time rank 0 spent (calibration and choice)."""


def refine_bucket_numel(spec: ModelSpec, world_size: int, timings: Sequence[BackwardTiming],
                        target: CalibrationTarget, world_group, control_device: torch.device,
                        options: PlanOptions, optimizer_seconds: tuple[float, int] | None = None,
                        how: QuickCalibration = QuickCalibration(),
                        cost_model: CostModel | None = None) -> RefinedBucket:
    """Calibrate (every rank), choose (rank 0, from its own `timings`) and agree.

    `spec` carries the agreed arrival order; `options` the plan's other knobs
    (alignment, reduce dtype, `max_buckets_in_flight`, memory budget). `cost_model`
    skips the calibration (tests, or a model the user measured). Collective over
    `world_group` and the groups of `target`."""
    t0 = perf_counter()
    cost = cost_model
    if cost is None and not target.groups:  # one rank: nothing is reduced, nothing to tune
        return RefinedBucket(None, "bucket_numel auto: no group of two or more ranks, so "
                                   "nothing to refine at run time", 0.0)
    if cost is None:
        cost = quick_cost_model(target, f"measured by this job on its {world_size} ranks",
                                optimizer_seconds, how, options.optimizer_impl)
    outcome = None
    if dist.get_rank(world_group) == 0:
        try:
            numel, note = decide(spec, world_size, timings, cost, options)
            outcome = (numel, f"{note}; refined at run time on rank 0 in "
                              f"{(perf_counter() - t0) * 1e3:,.0f} ms")
        except Exception as e:  # noqa: BLE001 - the others wait in the broadcast: never a hang
            warnings.warn(f"evenzero: the bucket size could not be refined at run time "
                          f"({type(e).__name__}: {e}); keeping the one chosen at construction",
                          RuntimeWarning, stacklevel=2)
            outcome = (None, f"bucket_numel auto: not refined at run time ({type(e).__name__} "
                             f"on rank 0: {e}); the construction-time choice stands")
    return agree_choice(outcome, perf_counter() - t0, world_group, control_device)


def decide(spec: ModelSpec, world_size: int, timings: Sequence[BackwardTiming], cost: CostModel,
           options: PlanOptions) -> tuple[int, str]:
    """(bucket size, note) from measured backwards and a cost model; pure."""
    choice = choose_bucket(spec, world_size, replace(options, cost_model=cost,
                                                     compute=measured_profile(timings)))
    return choice.numel, choice.note


def agree_choice(outcome: tuple[int | None, str] | None, seconds: float, world_group,
                 control_device: torch.device) -> RefinedBucket:
    """Rank 0's (numel or None, note) on every rank, in one broadcast; other ranks pass
    None."""
    vec = torch.zeros(3 + NOTE_BYTES, dtype=torch.float64, device=control_device)
    if outcome is not None:
        numel, note = outcome
        raw = note.encode()[:NOTE_BYTES]
        vec[0] = -1 if numel is None else numel
        vec[1] = seconds
        vec[2] = len(raw)
        if raw:
            vec[3:3 + len(raw)] = torch.tensor(list(raw), dtype=torch.float64)
    broadcast(vec, 0, world_group)
    values = vec.cpu()
    length = int(values[2])
    note = bytes(int(b) for b in values[3:3 + length].tolist()).decode(errors="replace")
    numel = int(values[0])
    return RefinedBucket(None if numel < 0 else numel, note, float(values[1]))


def calibration_target(groups: Sequence[tuple[int, Any]], device: torch.device,
                       dtype: torch.dtype, rs_algorithm: str) -> CalibrationTarget:
    """The target for groups given world first, one per distinct size of 2 or more ranks,
    with compute figures the quick calibration does not measure from the matching preset."""
    from evenzero.cost.presets import CPU_LOCAL, H100

    seen, kept = set(), []
    for size, group in groups:
        if size >= 2 and size not in seen:
            seen.add(size)
            kept.append((size, group))
    return CalibrationTarget(tuple(kept), device, dtype, rs_algorithm,
                             H100 if device.type == "cuda" else CPU_LOCAL)


__all__ = ["CalibrationTarget", "QuickCalibration", "RefinedBucket", "agree_choice",
           "calibration_target", "decide", "quick_cost_model", "refine_bucket_numel"]
