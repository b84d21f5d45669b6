"""The step timeline: hand-built plans with known answers, and properties of real plans."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from evenzero.cost import CostModel, OpCost, Variant
from evenzero.cost.compute import ComputeProfile, DeviceCompute
from evenzero.cost.presets import PRESETS
from evenzero.cost.timeline import COMM, COMPUTE, simulate
from evenzero.model_presets import preset
from evenzero.plan import (
    BACKWARD,
    STEP,
    Bucket,
    Collective,
    Execution,
    GroupInfo,
    Plan,
    Slot,
    StepWork,
)
from evenzero.spec import GroupSpec, ModelSpec, ParamSpec
from evenzero.strategies import STRATEGY_NAMES, PlanOptions, plan

MS = 1e-3
FAST = DeviceCompute("test", tflops=1.0, memory_gbs=1e12, optimizer_bytes_per_element=1e-6)
"""Copies and the optimizer cost (next to) nothing, so the answers are in round ms."""


def flat_cost(alpha_ms: float, device: DeviceCompute = FAST) -> CostModel:
    """Every call of every op costs exactly `alpha_ms`, whatever its size."""
    op = OpCost((Variant("flat", alpha_ms * 1e3, 1e12),))
    return CostModel("flat", "test", op, op, op, op, compute=device)


def tiny_plan(buckets: dict[int, list[str]], execution: Execution, step=()) -> Plan:
    """Buckets of group "g" (4 ranks), in the given plan order, one reduce-scatter each."""
    bs = tuple(Bucket("g", i, 4 * len(names), tuple(Slot(n, 4 * k, 4) for k, n in enumerate(names)))
               for i, names in buckets.items())
    calls = tuple(Collective(BACKWARD, "reduce_scatter", "g", 4, None, b.index, 0, b.numel) for b in bs)
    return Plan("test", 4, (GroupInfo("g", 4, 1, 4 * sum(map(len, buckets.values()))),), bs, bs,
                calls + tuple(step), execution=execution)


def profile(*names: str, each_ms: float = 1.0, forward_ms: float = 0.0,
            tail_ms: float = 0.0) -> ComputeProfile:
    return ComputeProfile(tuple((n, each_ms * MS) for n in names), forward_ms * MS, tail_ms * MS)


def comm_spans(t) -> list[tuple[float, float]]:
    return [(round(s.start / MS, 6), round(s.end / MS, 6)) for s in t.segments if s.lane == COMM]


# --------------------------------------------------------------------------- known answers


def test_a_complete_bucket_waits_behind_an_incomplete_one():
    # Bucket 0 = {a, c} completes after c (3 ms); bucket 1 = {b} after b (2 ms).
    buckets = {0: ["a", "c"], 1: ["b"]}
    prof = profile("a", "b", "c")
    in_order = simulate(tiny_plan(buckets, Execution(max_in_flight=None)), flat_cost(0.5), prof)
    assert comm_spans(in_order) == [(3, 3.5), (3.5, 4)]
    assert in_order.backward_end_s == pytest.approx(4 * MS)
    when_ready = simulate(tiny_plan(buckets, Execution(max_in_flight=None, launch_in_order=False)),
                          flat_cost(0.5), prof)
    assert comm_spans(when_ready) == [(2, 2.5), (3, 3.5)]
    assert when_ready.total_s == pytest.approx(3.5 * MS)


@pytest.mark.parametrize("limit, total_ms, waits_ms", [
    (None, 11.0, 2.0),   # calls queue on the comm lane; only the end of backward waits
    (2, 11.0, 2.0),      # the 3rd and 4th launches wait for the oldest: 0.5 + 1.5 ms
    (1, 13.5, 4.5),      # every launch waits for the previous call: 3 x 1.5 ms
    (0, 19.0, 10.0),     # every call blocks compute: 4 x 2.5 ms
])
def test_buckets_in_flight_limit_stalls_compute(limit, total_ms, waits_ms):
    # Four 1 ms gradients, each its own bucket, 2.5 ms per call, then 5 ms of compute left.
    names = ["p0", "p1", "p2", "p3"]
    p = tiny_plan({i: [n] for i, n in enumerate(names)}, Execution(max_in_flight=limit))
    t = simulate(p, flat_cost(2.5), profile(*names, tail_ms=5))
    assert t.total_s == pytest.approx(total_ms * MS)
    waits = sum(s.end - s.start for s in t.segments if s.kind == "wait")
    assert waits == pytest.approx(waits_ms * MS)
    assert t.compute_s == pytest.approx(9 * MS)
    assert t.exposed_comm_s == pytest.approx((total_ms - 9) * MS)


def test_communication_longer_than_compute_is_exposed():
    p = tiny_plan({0: ["a"]}, Execution())
    t = simulate(p, flat_cost(5.0), profile("a", forward_ms=2))
    assert (t.forward_end_s, t.backward_end_s, t.total_s) == pytest.approx((2 * MS, 8 * MS, 8 * MS))
    assert t.compute_s == pytest.approx(3 * MS)
    assert t.exposed_comm_s == pytest.approx(5 * MS) and t.hidden_comm_s == pytest.approx(0)
    # Communication shorter than the compute after it hides completely.
    hidden = simulate(tiny_plan({0: ["a"]}, Execution()), flat_cost(0.5),
                      profile("a", tail_ms=3))
    assert hidden.exposed_comm_s == pytest.approx(0) and hidden.hidden_comm_s == pytest.approx(0.5 * MS)


def test_a_missing_gradient_holds_its_bucket_until_the_flush():
    # "m" never produces a gradient: bucket 0 = {a, m} goes out with the end-of-backward flush.
    buckets = {0: ["a", "m"], 1: ["b"]}
    prof = profile("a", "b")
    held = simulate(tiny_plan(buckets, Execution(max_in_flight=None)), flat_cost(0.5), prof)
    assert comm_spans(held) == [(2, 2.5), (2.5, 3)]
    free = simulate(tiny_plan(buckets, Execution(max_in_flight=None, missing_grads_hold_bucket=False)),
                    flat_cost(0.5), prof)
    assert comm_spans(free) == [(1, 1.5), (2, 2.5)]


def test_step_collectives_bracket_the_optimizer():
    # One 1M-element shard per rank: 4 ms of optimizer at 4 B/element and 1 GB/s.
    device = DeviceCompute("slow", tflops=1.0, memory_gbs=1.0, optimizer_bytes_per_element=4)
    step = (Collective(STEP, "all_reduce", "world", 4, None, None, 0, 8),
            Collective(STEP, "all_gather", "g", 4, None, 0, 0, 4))
    p = tiny_plan({0: ["a"]}, Execution(copies_grads=False), step)
    p = Plan(p.strategy, 4, (GroupInfo("g", 4, 1, 4),), p.buckets,
             (Bucket("g", 0, 4 * 10**6, (Slot("a", 0, 4),)),), p.collectives,
             execution=p.execution)
    t = simulate(p, flat_cost(1.0, device), profile("a"))
    # backward 1 + RS 1, then all-reduce 1, optimizer 1M x 4 B / 1 GB/s = 4 ms, gather 1.
    assert comm_spans(t) == [(1, 2), (2, 3), (7, 8)]
    assert t.backward_end_s == pytest.approx(2 * MS) and t.total_s == pytest.approx(8 * MS)
    assert [s.kind for s in t.segments if s.lane == COMPUTE] == [
        "backward", "wait", "wait", "optimizer", "wait"]


def test_gathers_in_forward_overlap_it():
    step = tuple(Collective(STEP, "all_gather", "g", 4, None, i, 0, 4) for i in range(2))
    # In forward: gather 0 [0, 1], forward half [1, 3] beside gather 1 [1, 2], forward
    # half [3, 5]; backward [5, 6], its reduce-scatter [6, 7]. After the step instead:
    # forward 4, backward 1, reduce-scatter 1, then the two gathers, 2.
    for in_forward, total in ((True, 7), (False, 8)):
        p = tiny_plan({0: ["a"]}, Execution(copies_grads=False, overlap_param_gather=in_forward), step)
        t = simulate(p, flat_cost(1.0), profile("a", forward_ms=4))
        assert t.total_s == pytest.approx(total * MS), in_forward
        assert t.forward_end_s == pytest.approx((5 if in_forward else 4) * MS)


def test_collectives_slow_compute_by_the_comm_slowdown():
    device = DeviceCompute("shared", tflops=1.0, memory_gbs=1e12, comm_slowdown=1.0)
    p = tiny_plan({0: ["a"]}, Execution(copies_grads=False))
    # 2 ms of tail compute beside a 1 ms call: half speed for 1 ms, then full speed.
    t = simulate(p, flat_cost(1.0, device), ComputeProfile((("a", MS),), 0.0, 2 * MS))
    assert t.total_s == pytest.approx(3.5 * MS)
    assert t.exposed_comm_s == pytest.approx(0.5 * MS)


def test_compute_slows_collectives_by_the_collective_slowdown():
    # Both halve each other: a 1 ms call beside 2 ms of compute. For 2 ms both run at half
    # speed (the call is done, compute has 1 ms left), then compute runs alone: 3 ms, the
    # sum of the two, as on cores the ranks already fill (without the factor, 2.5 ms);
    # 1 ms of backward compute comes before.
    shared = DeviceCompute("shared", tflops=1.0, memory_gbs=1e12, comm_slowdown=1.0,
                           collective_slowdown=1.0)
    p = tiny_plan({0: ["a"]}, Execution(copies_grads=False))
    prof = ComputeProfile((("a", MS),), 0.0, 2 * MS)
    t = simulate(p, flat_cost(1.0, shared), prof)
    assert t.total_s == pytest.approx(4.0 * MS)
    call = next(s for s in t.segments if s.lane == "comm")
    assert call.end - call.start == pytest.approx(2.0 * MS)
    one_way = DeviceCompute("one-way", tflops=1.0, memory_gbs=1e12, comm_slowdown=1.0)
    assert simulate(p, flat_cost(1.0, one_way), prof).total_s == pytest.approx(3.5 * MS)
    with pytest.raises(ValueError, match="collective_slowdown"):
        DeviceCompute("x", tflops=1, memory_gbs=1, collective_slowdown=-0.5)


def test_execution_override_and_a_model_without_compute():
    p = tiny_plan({i: [n] for i, n in enumerate("abcd")}, Execution(max_in_flight=0))
    blocking = simulate(p, flat_cost(2.5), profile(*"abcd", tail_ms=5))
    free = simulate(p, flat_cost(2.5), profile(*"abcd", tail_ms=5), Execution(max_in_flight=None))
    assert free.total_s < blocking.total_s
    from evenzero.cost import CostModelError

    no_compute = CostModel("bare", "", *([OpCost((Variant("x", 1, 1),))] * 4))
    with pytest.raises(CostModelError, match="no compute figures"):
        simulate(p, no_compute, profile(*"abcd"))


# --------------------------------------------------------------------------- real plans


def test_every_strategy_plays_on_the_seed_case():
    spec = preset("seed-moe")
    from evenzero.cost.compute import estimate_profile

    cost = PRESETS["gloo-local"]
    prof = estimate_profile(spec, cost.compute)
    for name in (*STRATEGY_NAMES, "deepspeed-reduce-mode"):
        p = plan(spec, 8, name, PlanOptions(cost_model=cost))
        t = simulate(p, cost, prof)
        assert len([s for s in t.segments if s.lane == COMM]) == len(p.collectives), name
        assert t.total_s >= t.compute_s > 0
        # Measured by the repro: evenzero's step is well under the 0.6 schedule's.
    ez = simulate(plan(spec, 8, "evenzero", PlanOptions(cost_model=cost)), cost, prof)
    ds = simulate(plan(spec, 8, "deepspeed-0.6"), cost, prof)
    assert ez.total_s < 0.75 * ds.total_s and ez.backward_s < ds.backward_s


@st.composite
def cases(draw):
    world = draw(st.sampled_from([2, 4, 8]))
    n = draw(st.integers(1, 12))
    params = tuple(ParamSpec(f"p{i}", tuple(draw(st.lists(st.integers(1, 64), min_size=1,
                                                          max_size=2))),
                             draw(st.sampled_from(["dense", "experts"]))) for i in range(n))
    names = [p.name for p in params]
    arrival = draw(st.permutations(names))[:draw(st.integers(1, n))]
    spec = ModelSpec(params, (GroupSpec("dense"), GroupSpec("experts", 2)), tuple(arrival))
    if not spec.group_params("dense") and not spec.group_params("experts"):
        spec = ModelSpec(params[:1], spec.groups)
    strategy = draw(st.sampled_from(sorted({*STRATEGY_NAMES, "deepspeed-reduce-mode"})))
    bucket = draw(st.integers(16, 4096))
    times = tuple((name, draw(st.floats(0, 2e-3))) for name in spec.arrival_order)
    alpha = draw(st.floats(1.0, 3000.0))
    return spec, world, strategy, bucket, ComputeProfile(times, draw(st.floats(0, 1e-3))), alpha


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_timeline_properties(case):
    spec, world, strategy, bucket, prof, alpha = case
    p = plan(spec, world, strategy, PlanOptions(bucket_numel=bucket))
    t = simulate(p, flat_cost(alpha / 1e3), prof)
    for lane in (COMPUTE, COMM):
        spans = sorted((s.start, s.end) for s in t.segments if s.lane == lane)
        assert all(a <= b + 1e-12 for (_, a), (b, _) in zip(spans, spans[1:], strict=False))
        assert all(0 <= s <= e <= t.total_s + 1e-12 for s, e in spans)
    assert len([s for s in t.segments if s.lane == COMM]) == len(p.collectives)
    assert t.total_s >= max(t.compute_s, t.comm_s) - 1e-12
    assert t.forward_end_s <= t.backward_end_s <= t.total_s
    # Dearer calls never make the step shorter; free calls leave compute alone.
    dearer = simulate(p, flat_cost(2 * alpha / 1e3), prof)
    assert dearer.total_s >= t.total_s - 1e-12
    free = simulate(p, flat_cost(0.0), prof)
    assert free.total_s == pytest.approx(free.compute_s, abs=1e-12)


# --------------------------------------------------------------------------- the step's work


STEPPY = DeviceCompute("steppy", tflops=1.0, memory_gbs=1.0, optimizer_bytes_per_element=10.0,
                       default_optimizer_impl="single_tensor", fused_bytes_per_element=2.0,
                       norm_fp32_bytes_per_element=4.0, norm_fp64_bytes_per_element=20.0,
                       tensor_overhead_us=100.0, param_overhead_us=10.0)
"""1 GB/s, so 1e6 bytes of traffic is 1 ms."""


def stepped(work: StepWork, gather_copies: bool = False):
    step = (Collective(STEP, "all_reduce", "world", 4, None, None, 0, 8),
            Collective(STEP, "all_gather", "g", 4, None, 0, 0, 250_000))
    p = replace(tiny_plan({0: ["a"]}, Execution(copies_grads=False), step), step_work=work)
    cost = replace(flat_cost(1.0, STEPPY), all_gather_copies_output=gather_copies)
    return simulate(p, cost, profile("a"))


def spans(t, kind: str) -> list[float]:
    return [round((s.end - s.start) / MS, 6) for s in t.segments
            if s.lane == COMPUTE and s.kind == kind]


def test_the_step_charges_bookkeeping_norm_copies_and_the_optimizer():
    work = StepWork(optimizer_elements=10**5, optimizer_impl=None, norm="fp64",
                    norm_elements=10**5, copy_bytes=3 * 10**6,
                    optimizer_tensor_numels=(5000,) * 20, params=100)
    t = stepped(work)
    # bookkeeping: 100 visits x 10 us + 20 tensors x 100 us (single-tensor, the default)
    assert spans(t, "bookkeeping") == [3.0]
    assert spans(t, "norm") == [2.0]  # 1e5 x 20 B at 1 GB/s
    assert spans(t, "copy") == [3.0]
    assert spans(t, "optimizer") == [1.0]  # 1e5 x 10 B, the default implementation
    # backward 1 + RS 1, bookkeeping 3, norm 2, all-reduce 1, copies 3, optimizer 1, gather 1
    assert t.total_s == pytest.approx(13 * MS)
    kinds = [s.kind for s in t.segments if s.lane == COMPUTE and s.kind != "wait"]
    assert kinds == ["backward", "bookkeeping", "norm", "copy", "optimizer"]
    # fused: its own bytes, no per-tensor loop; an fp32 norm; masters aliased: no copy.
    fused = stepped(replace(work, optimizer_impl="fused", norm="fp32", copy_bytes=0))
    assert spans(fused, "bookkeeping") == [1.0] and spans(fused, "norm") == [0.4]
    assert spans(fused, "optimizer") == [0.2] and spans(fused, "copy") == []
    assert fused.total_s == pytest.approx(5.6 * MS)


def test_a_gather_that_copies_out_of_a_temporary_pays_the_copy():
    work = StepWork(optimizer_elements=0)
    plain, copying = stepped(work), stepped(work, gather_copies=True)
    # 250,000 x 4 B read and written again at 1 GB/s: 2 ms more on the comm lane.
    assert copying.total_s - plain.total_s == pytest.approx(2 * MS)
    assert comm_spans(copying)[-1][1] - comm_spans(copying)[-1][0] == pytest.approx(3)


def test_a_plan_without_step_work_runs_the_default_optimizer_only():
    p = tiny_plan({0: ["a"]}, Execution(copies_grads=False))
    t = simulate(p, flat_cost(1.0, STEPPY), profile("a"))
    assert spans(t, "optimizer") == [pytest.approx(4 * 10 / 4 * 1e-6)]  # 4 elements / 4 ranks
    assert spans(t, "norm") == spans(t, "copy") == []
    assert spans(t, "bookkeeping") == [0.1]  # the single-tensor loop over its one tensor


def test_evenzero_step_predicts_less_with_aliased_masters_and_a_fused_optimizer():
    spec = preset("seed-moe")
    cost = PRESETS["gloo-local"]
    fast = plan(spec, 8, "evenzero", PlanOptions(bucket_numel=2**22))
    slow = plan(spec, 8, "evenzero", PlanOptions(bucket_numel=2**22, master_dtype="float64",
                                                 optimizer_impl="single_tensor"))
    assert fast.step_work.copy_bytes == 0 and slow.step_work.copy_bytes > 0
    assert fast.step_work.optimizer_impl == "fused"
    prof = ComputeProfile(tuple((n, MS) for n in spec.arrival_order), 10 * MS)
    assert simulate(fast, cost, prof).step_phase_s < simulate(slow, cost, prof).step_phase_s
