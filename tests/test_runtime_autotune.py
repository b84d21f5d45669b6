"""The runtime's bucket size refinement: measured backwards + quick calibration -> one
size every rank agrees on (`evenzero.runtime.autotune`)."""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
import torch

from dist_helpers import run_distributed
from evenzero.cost import CostModel, OpCost, Variant
from evenzero.cost.autobucket import candidate_sizes
from evenzero.cost.compute import DeviceCompute
from evenzero.runtime import autotune, backwardclock
from evenzero.runtime.autotune import decide
from evenzero.runtime.backwardclock import (
    ArrivalClock,
    BackwardTiming,
    RefinementSchedule,
    measured_profile,
)
from evenzero.spec import ModelSpec, ParamSpec
from evenzero.strategies import PlanOptions, choose_bucket

DEVICE = DeviceCompute("test", tflops=1.0, memory_gbs=1e3, optimizer_bytes_per_element=1.0)


def cost_model(alpha_us: float = 100.0, busbw_gbs: float = 1.0) -> CostModel:
    op = OpCost((Variant("flat", alpha_us, busbw_gbs),))
    return CostModel("fixed", "", op, op, op, op, compute=DEVICE)


def spec(n: int = 32, numel: int = 2**18) -> ModelSpec:
    params = tuple(ParamSpec(f"l{i}.weight", (numel,)) for i in range(n))
    return ModelSpec(params).with_arrival([p.name for p in reversed(params)], "measured")


def timing(model: ModelSpec, per_param_s: float, start: float = 100.0) -> BackwardTiming:
    """A backward whose gradients arrive `per_param_s` apart, in the spec's order."""
    t = BackwardTiming(start, forward_s=per_param_s)
    for i, name in enumerate(model.arrival_order):
        t.events.append((name, start + (i + 1) * per_param_s))
    t.end = t.events[-1][1] + 1e-6  # nothing after the last gradient to hide behind
    return t


# ---------------------------------------------------------------------- measuring


def test_clock_records_one_timing_per_backward(monkeypatch):
    ticks = iter([1.0, 1.5, 2.0, 2.25, 2.75, 3.0, 10.0, 10.5, 11.0])
    monkeypatch.setattr(backwardclock, "perf_counter", lambda: next(ticks))
    clock = ArrivalClock()
    clock.forward_began()            # 1.0
    clock.forward_ended()            # 1.5
    clock.output_grad()              # 2.0: backward of the model begins
    clock.grad("b")                  # 2.25
    clock.grad("a")                  # 2.75
    clock.backward_ended()           # 3.0
    clock.grad("b")                  # 10.0: a backward without forward or output hook
    clock.grad("a")                  # 10.5
    clock.backward_ended()           # 11.0
    first, second = clock.take()
    assert (first.start, first.events, first.end, first.forward_s) == (
        2.0, [("b", 2.25), ("a", 2.75)], 3.0, 0.5)
    assert (second.start, second.forward_s, second.end) == (10.0, None, 11.0)
    assert clock.take() == []
    p = first.profile()
    assert p.backward == (("b", 0.25), ("a", 0.5))
    assert p.tail_s == pytest.approx(0.25)
    assert p.forward_s == 0.5


def test_measured_profile_leaves_out_the_first_backward_and_takes_medians():
    model = spec(4)
    cold, warm = timing(model, 1.0), [timing(model, s) for s in (0.1, 0.3, 0.2)]
    p = measured_profile([cold, *warm])
    assert [t for _, t in p.backward] == pytest.approx([0.2] * 4)
    assert measured_profile([cold]).backward[0][1] == pytest.approx(1.0)  # alone, it counts
    with pytest.raises(ValueError, match="no complete measured backward"):
        measured_profile([BackwardTiming(0.0)])


def test_schedule_refines_after_enough_synced_backwards():
    schedule = RefinementSchedule(enabled=True, backwards=3)
    clock = schedule.clock

    def backward(name: str, aborted: bool = False, synced: bool = True, arrival: bool = True):
        clock.output_grad()
        clock.grad(name)
        return schedule.backward_ended(aborted, synced, arrival)

    assert backward("a") is None
    # Raised on this rank: its timing is dropped, but it counts (every rank refines at
    # the same synced backward).
    assert backward("b", aborted=True) is None and schedule.pending
    # Under no_sync(): timed, not counted (ranks may run different numbers of them).
    assert backward("c", synced=False) is None and schedule.synced == 2
    assert backward("d", arrival=False) is None  # the arrival order is not agreed yet
    timings = backward("e")
    assert [[n for n, _ in t.events] for t in timings] == [["a"], ["c"], ["d"], ["e"]]
    assert not schedule.pending and schedule.clock is None
    assert schedule.backward_ended(False, True, True) is None  # once only
    off = RefinementSchedule(enabled=False)
    assert not off.pending and off.backward_ended(False, True, True) is None


# ---------------------------------------------------------------------- choosing


def test_fake_measurement_gives_a_deterministic_choice():
    model = spec()
    options = PlanOptions(max_buckets_in_flight=2)
    slow = [timing(model, 0.05), timing(model, 0.05)]
    numel, note = decide(model, 8, slow, cost_model(), options)
    assert (numel, note) == decide(model, 8, slow, cost_model(), options)
    # The planner's rule on the measured profile, nothing else.
    assert numel == choose_bucket(model, 8, replace(options, cost_model=cost_model(),
                                                    compute=measured_profile(slow))).numel
    assert "measured gradient arrivals" in note
    # Long backward compute hides small buckets; negligible compute leaves nothing to
    # hide behind, so the fewest calls (one bucket) win.
    fast = [timing(model, 1e-7), timing(model, 1e-7)]
    whole = max(candidate_sizes(model))
    assert numel < whole
    assert decide(model, 8, fast, cost_model(), options)[0] == whole


def test_one_rank_has_nothing_to_refine():
    target = autotune.CalibrationTarget((), torch.device("cpu"), torch.float32, "all_to_all+sum",
                                        DEVICE)
    out = autotune.refine_bucket_numel(spec(), 1, [timing(spec(), 0.01)], target, None,
                                       torch.device("cpu"), PlanOptions())
    assert out.numel is None and "nothing to refine" in out.note


# ---------------------------------------------------------------------- agreeing


def _agree_job(rank: int, world_size: int, calibrate: bool, rank0_empty: bool):
    import torch.distributed as dist

    model = spec()
    # Each rank measured something else; only rank 0's counts.
    mine = [timing(model, 0.05 if rank == 0 else 1e-7)] * 2
    if rank0_empty and rank == 0:
        mine = []
    target = autotune.calibration_target([(world_size, dist.group.WORLD)], torch.device("cpu"),
                                         torch.float32, "all_to_all+sum")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = autotune.refine_bucket_numel(
            model, world_size, mine, target, dist.group.WORLD, torch.device("cpu"),
            PlanOptions(max_buckets_in_flight=2), optimizer_seconds=(0.01, 2**20),
            cost_model=None if calibrate else cost_model())
    expected = decide(model, world_size, [timing(model, 0.05)] * 2, cost_model(),
                      PlanOptions(max_buckets_in_flight=2))[0]
    return out, expected, [str(w.message) for w in seen]


def test_ranks_agree_on_rank_0s_choice():
    (a, expected, _), (b, _, _) = run_distributed(_agree_job, 2, (False, False))
    assert a == b
    assert a.numel == expected  # rank 1's own timings would have chosen one bucket
    assert a.note.startswith("bucket_numel auto:") and "refined at run time" in a.note


def test_quick_calibration_is_agreed_and_short():
    (a, _, _), (b, _, _) = run_distributed(_agree_job, 2, (True, False))
    assert a == b
    assert a.numel in candidate_sizes(spec())
    assert "cost model measured by this job on its 2 ranks" in a.note
    # Bounded by design (a few sizes, two calls each); loose, for a loaded CI machine.
    assert a.seconds < 10.0


def test_a_failure_on_rank_0_is_agreed_and_keeps_the_plan():
    (a, _, warned), (b, _, quiet) = run_distributed(_agree_job, 2, (False, True))
    assert a == b and a.numel is None
    assert "not refined at run time" in a.note and "no complete measured backward" in a.note
    assert any("could not be refined" in w for w in warned) and not quiet
