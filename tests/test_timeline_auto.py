"""`bucket_numel="auto"`: the size with the shortest predicted step, within the budget."""

from __future__ import annotations

import pytest

from evenzero.cost import CostModel, OpCost, Variant
from evenzero.cost.autobucket import (
    BUDGET_CAP,
    BUDGET_FLOOR,
    STRESS,
    TIE,
    choose_bucket_numel,
    default_memory_budget,
    inflight_bytes,
    slower_communication,
)
from evenzero.cost.compute import DeviceCompute, profile_from_times
from evenzero.cost.presets import PRESETS
from evenzero.model_presets import preset
from evenzero.spec import ModelSpec, ParamSpec
from evenzero.strategies import PlanOptions, plan
from evenzero.strategies.evenzero import plan_evenzero

DEVICE = DeviceCompute("test", tflops=1.0, memory_gbs=1e6, optimizer_bytes_per_element=1e-6)


def cost(alpha_us: float, busbw_gbs: float) -> CostModel:
    op = OpCost((Variant("flat", alpha_us, busbw_gbs),))
    return CostModel("test", "", op, op, op, op, compute=DEVICE)


def choose(spec: ModelSpec, world: int, model: CostModel, compute=None, memory_budget=None):
    """The cost layer's choice over evenzero's cut of `spec`."""
    def cut(numel: int):
        return plan_evenzero(spec, world, PlanOptions(bucket_numel=numel))

    return choose_bucket_numel(spec, model, cut, compute, memory_budget)


def layers(n: int = 32, dim: int = 1024, tokens: int = 4096) -> ModelSpec:
    """n square layers, fp32: 4 x tokens x dim^2 FLOPs of backward each."""
    return ModelSpec(tuple(ParamSpec(f"l{i}.weight", (dim, dim)) for i in range(n)),
                     tokens=tokens)


def test_overlap_pays_so_several_buckets():
    # 32 x 17 ms of backward; 4 MiB per layer at ~1 GB/s is 3.7 ms; 50 us per call.
    spec = layers()
    choice = choose(spec, 8, cost(50, 1.0))
    single = max(choice.candidates, key=lambda c: c.numel)
    assert 1 < len(choice.plan.buckets) <= 32 and choice.numel < single.numel
    assert choice.timeline.total_s < 0.9 * single.step_s
    # The smallest worst-case regret over the calibrated model and the stressed one
    # (communication STRESS x slower); among ties, the fewest buckets.
    fit = [c for c in choice.candidates if c.fits]
    best, best_stressed = min(c.step_s for c in fit), min(c.stressed_s for c in fit)

    def regret(c):
        return max(c.step_s / best, c.stressed_s / best_stressed)

    mine = next(c for c in fit if c.numel == choice.numel)
    assert regret(mine) <= min(map(regret, fit)) + TIE
    assert all(c.buckets > mine.buckets for c in fit if regret(c) < regret(mine))
    # The candidates are what they say: the plan is the fixed plan of the chosen size.
    fixed = plan(spec, 8, "evenzero", PlanOptions(bucket_numel=choice.numel))
    assert fixed.buckets == choice.plan.buckets


def test_latency_dominates_so_one_bucket():
    # Tiny compute, 50 ms per call: every extra call is a loss.
    spec = layers(n=8, dim=256, tokens=1)
    choice = choose(spec, 8, cost(50_000, 100.0))
    assert len(choice.plan.buckets) == 1 and choice.numel == spec.numel


def test_ties_go_to_fewer_buckets():
    # No communication cost and no compute: every size predicts the same step.
    spec = layers(n=8, dim=256, tokens=1)
    free = CostModel("free", "", *([OpCost((Variant("x", 0.0, 1e12),))] * 4), compute=DEVICE)
    assert len(choose(spec, 4, free).plan.buckets) == 1


def test_stressed_model_is_slower_communication_only():
    base = cost(50, 1.0)
    slow = slower_communication(base, STRESS)
    for op in ("all_reduce", "reduce_scatter", "all_gather", "reduce"):
        for n in (4096, 2**24):
            assert slow.time(op, 8, n) == pytest.approx(STRESS * base.time(op, 8, n))
    assert slow.compute == base.compute


def test_memory_budget_is_respected():
    spec = layers()
    held = inflight_bytes(plan_evenzero(spec, 8, PlanOptions(bucket_numel=spec.numel)), 2)
    assert held == 32 * 2**22  # one bucket of every gradient
    for budget in (2**24, 2**26):  # 16 MiB: 2 x 2 layers; 64 MiB: 2 x 8 layers
        choice = choose(spec, 8, cost(50_000, 100.0), memory_budget=budget)
        assert inflight_bytes(choice.plan, 2) <= budget
        assert {c.fits for c in choice.candidates} == {True, False}
        assert all(c.fits == (c.inflight_bytes <= budget) for c in choice.candidates)
        assert f"{budget / 2**20:.1f} MiB budget" in choice.note
    # Under one parameter: nothing fits, the least memory is taken and the note says so.
    tight = choose(spec, 8, cost(50, 1.0), memory_budget=2**20)
    assert len(tight.plan.buckets) == 32 and "no size fits" in tight.note


def test_default_budget_is_a_quarter_of_the_gradients_within_bounds():
    assert default_memory_budget(layers(n=4)) == BUDGET_FLOOR  # 16 MiB of gradients
    big = layers(n=4096)  # 16 GiB
    assert default_memory_budget(big) == BUDGET_CAP
    mid = layers(n=512)  # 2 GiB of fp32 gradients; bf16 messages halve them
    assert default_memory_budget(mid) == 2**29
    assert default_memory_budget(mid, "bfloat16") == 2**28


def test_explicit_size_wins_and_auto_is_the_default():
    spec = layers()
    fixed = plan_evenzero(spec, 8, PlanOptions(bucket_numel=2**21, cost_model=cost(50, 1.0)))
    assert len(fixed.buckets) == 16 and not any("auto" in n for n in fixed.notes)
    assert fixed.bucket_numel == 2**21
    auto = plan_evenzero(spec, 8, PlanOptions(cost_model=cost(50, 1.0)))
    chosen = choose(spec, 8, cost(50, 1.0)).numel
    assert auto.bucket_numel == chosen  # the plan records the size "auto" chose
    assert auto == plan_evenzero(spec, 8, PlanOptions(bucket_numel="auto", cost_model=cost(50, 1.0)))
    assert auto.notes[-1].startswith("bucket_numel auto: ") and "cost model test" in auto.notes[-1]
    # Other strategies read "auto" as their own default.
    assert plan(spec, 8, "megatron", PlanOptions(bucket_numel="auto")) == plan(spec, 8, "megatron")


def test_measured_compute_decides_for_the_runtime():
    """The runtime's entry point: seconds per parameter instead of FLOPs."""
    spec = layers(tokens=1)  # by FLOPs, next to no compute: one bucket
    model = cost(50, 1.0)
    by_flops = choose(spec, 8, model)
    measured = {p.name: 20e-3 for p in spec.params}  # the first backwards said 20 ms each
    by_time = choose(spec, 8, model, measured)
    assert len(by_flops.plan.buckets) < len(by_time.plan.buckets)
    assert by_time.note.endswith("compute: measured")
    again = choose(spec, 8, model, profile_from_times(spec, measured))
    assert again.numel == by_time.numel
    with pytest.raises(ValueError, match="does not have"):
        choose(spec, 8, model, {"nope": 1.0})


def test_default_plans_of_the_presets():
    # gpt2-xl on 128 InfiniBand ranks: big buckets (latency ~200 us a call) within 1 GiB.
    p = plan(preset("gpt2-xl"), 128, "evenzero")
    assert 4 <= len(p.buckets) <= 24 and inflight_bytes(p, 2) <= BUDGET_CAP
    # The seed case on the CPU preset: more than one bucket, so reductions overlap.
    seed = plan(preset("seed-moe"), 8, "evenzero", PlanOptions(cost_model=PRESETS["gloo-local"]))
    assert len(seed.buckets) > 2


def test_a_cost_model_without_compute_still_plans():
    # A calibration saved before compute was measured: FLOPs on the H100's figures.
    bare = CostModel("bare", "", *([OpCost((Variant("x", 10.0, 10.0),))] * 4))
    p = plan_evenzero(layers(), 8, PlanOptions(cost_model=bare))
    assert "cost model bare" in p.notes[-1] and p.notes[-1].endswith("on h100")
