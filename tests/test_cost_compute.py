"""Compute figures and profiles, per-size variants, and fitting across group sizes."""

from __future__ import annotations

import json

import pytest

from evenzero.cost import OPS, CostModel, CostModelError, OpCost, Sample, Variant
from evenzero.cost.compute import (
    DEFAULT_TOKENS,
    LARGE_TENSOR_NUMEL,
    SMALL_TENSOR_NUMEL,
    DeviceCompute,
    backward_work,
    estimate_profile,
    median_profile,
    profile_from_arrivals,
    profile_from_times,
)
from evenzero.cost.model import FORMAT
from evenzero.cost.presets import PRESETS
from evenzero.model_presets import preset
from evenzero.spec import ModelSpec, ParamSpec, SpecError
from evenzero.spec_json import from_json


def test_backward_work_by_layer_kind():
    linear = ParamSpec("w", (300, 200))
    flops, nbytes = backward_work(linear, 10)
    assert flops == 4 * 10 * 60_000
    assert nbytes == 4 * (2 * 60_000 + 10 * (2 * 200 + 300))
    emb = ParamSpec("e", (1000, 64), layer="embedding", dtype="bfloat16")
    assert backward_work(emb, 10) == (10 * 64, 2 * (64_000 + 2 * 10 * 64))
    norm = ParamSpec("n", (64,))
    assert backward_work(norm, 10) == (8 * 10 * 64, 4 * (2 * 64 + 3 * 10 * 64))
    expert = ParamSpec("x", (300, 200), token_share=0.25, extra_backward_flops_per_token=7.0)
    assert backward_work(expert, 40)[0] == 4 * 10 * 60_000 + 40 * 7.0


def test_estimate_profile_follows_arrival_and_roofline():
    dev = DeviceCompute("d", tflops=1.0, memory_gbs=1.0)
    spec = ModelSpec((ParamSpec("a", (1000, 1000)), ParamSpec("b", (1000,))), tokens=1000)
    prof = estimate_profile(spec, dev)
    assert [n for n, _ in prof.backward] == ["b", "a"]
    # a: 4e9 FLOPs at 1 TFLOP/s = 4 ms; its 4*(2e6 + 3e6) bytes at 1 GB/s = 20 ms: memory wins.
    assert dict(prof.backward)["a"] == pytest.approx(20e-3)
    assert prof.forward_s == pytest.approx(prof.backward_s / 2)
    assert "1,000 tokens" in prof.source and "assumed" not in prof.source
    unknown = estimate_profile(ModelSpec(spec.params), dev)
    assert f"{DEFAULT_TOKENS:,} tokens" in unknown.source and "assumed" in unknown.source
    assert estimate_profile(spec, dev, tokens=10).backward_s < prof.backward_s


def test_profiles_from_measured_times():
    spec = ModelSpec((ParamSpec("a", (4,)), ParamSpec("b", (4,)), ParamSpec("c", (4,))))
    prof = profile_from_times(spec, {"c": 1.0, "a": 3.0})
    assert prof.backward == (("c", 1.0), ("b", 0.0), ("a", 3.0)) and prof.forward_s == 2.0
    events = [("c", 10.5), ("b", 11.0), ("c", 11.2), ("a", 12.0)]
    arr = profile_from_arrivals(events, backward_start=10.0, backward_end=12.5, forward_s=0.3)
    # c's second accumulation (11.2) is part of a's interval.
    assert [(n, round(t, 9)) for n, t in arr.backward] == [("c", 0.5), ("b", 0.5), ("a", 1.0)]
    assert arr.tail_s == pytest.approx(0.5) and arr.forward_s == 0.3
    with pytest.raises(ValueError, match="before the previous event"):
        profile_from_arrivals([("a", 2.0), ("b", 1.0)], backward_start=0.0)
    mid = median_profile([profile_from_times(spec, {"a": t}) for t in (1.0, 5.0, 2.0)])
    assert dict(mid.backward)["a"] == 2.0 and "median of 3" in mid.source


def test_device_compute_validation_json_and_overrides():
    with pytest.raises(ValueError, match="tflops must be a positive number"):
        DeviceCompute("x", tflops=0, memory_gbs=1)
    with pytest.raises(ValueError, match="comm_slowdown"):
        DeviceCompute("x", tflops=1, memory_gbs=1, comm_slowdown=-1)
    m = PRESETS["gloo-local"]
    again = CostModel.from_json(json.loads(json.dumps(m.to_json())))
    assert again == m and again.compute == m.compute and again.fitted_ranks == (8,)
    assert m.with_params({"compute.tflops": "2.5"}).compute.tflops == 2.5
    with pytest.raises(CostModelError, match="compute field 'speed'"):
        m.with_params({"compute.speed": 1})
    with pytest.raises(CostModelError, match="compute: unknown key"):
        CostModel.from_json({**m.to_json(), "compute": {"name": "x", "warp": 9}})
    old = {k: v for k, v in m.to_json().items() if k not in ("compute", "fitted_ranks")}
    assert CostModel.from_json(old).compute is None  # files from before compute existed


FORMAT_1_COMPUTE = {"name": "old", "tflops": 0.05, "memory_gbs": 6.0,
                    "optimizer_bytes_per_element": 120.0, "comm_slowdown": 0.4, "sources": "v1"}
"""The compute section `evenzero calibrate` wrote before the step costs (file format 1)."""


def test_step_costs_per_implementation_norm_and_parameter():
    c = DeviceCompute("c", tflops=1, memory_gbs=1, optimizer_bytes_per_element=100.0,
                      default_optimizer_impl="single_tensor", fused_bytes_per_element=20.0,
                      tensor_overhead_us=50.0, param_overhead_us=2.0)
    assert c.optimizer_bytes(None) == c.optimizer_bytes("single_tensor") == 100.0
    assert c.optimizer_bytes("fused") == 20.0
    assert c.optimizer_bytes("foreach") == 100.0  # not measured: as the default
    assert c.optimizer_seconds(10**6, "fused") == pytest.approx(0.02)
    assert c.norm_seconds(10**6, "fp32") == pytest.approx(0.004)
    assert c.norm_seconds(10**6, "fp64") == pytest.approx(0.02)
    assert c.norm_seconds(10**6, None) == 0.0
    # Visits always; the per-tensor loop only for the single-tensor implementation.
    assert c.bookkeeping_seconds(10, 4) == pytest.approx((20 + 200) * 1e-6)
    assert c.bookkeeping_seconds(10, 4, "fused") == pytest.approx(20e-6)
    assert c.with_optimizer_bytes(None, 90.0).optimizer_bytes_per_element == 90.0
    assert c.with_optimizer_bytes("foreach", 60.0).optimizer_bytes("foreach") == 60.0
    with pytest.raises(ValueError, match="not one of"):
        c.optimizer_bytes("apex")
    with pytest.raises(ValueError, match="default_optimizer_impl"):
        DeviceCompute("x", tflops=1, memory_gbs=1, default_optimizer_impl="apex")
    with pytest.raises(ValueError, match="fused_bytes_per_element must be a positive"):
        DeviceCompute("x", tflops=1, memory_gbs=1, fused_bytes_per_element=0)
    assert c.with_param("fused_bytes_per_element", "12").fused_bytes_per_element == 12.0


def test_optimizer_cost_follows_tensor_size_between_the_two_figures():
    c = DeviceCompute("c", tflops=1, memory_gbs=1, optimizer_bytes_per_element=100.0,
                      default_optimizer_impl="single_tensor",
                      single_tensor_small_bytes_per_element=40.0)
    assert c.optimizer_bytes_at(None, SMALL_TENSOR_NUMEL // 2) == 40.0
    assert c.optimizer_bytes_at(None, LARGE_TENSOR_NUMEL * 2) == 100.0
    middle = int((SMALL_TENSOR_NUMEL * LARGE_TENSOR_NUMEL) ** 0.5)  # halfway in log(numel)
    assert c.optimizer_bytes_at("single_tensor", middle) == pytest.approx(70.0, rel=1e-3)
    assert c.optimizer_bytes_at("fused", 10) == 100.0  # no small figure: as on large tensors
    # Many small tensors cost less per element than one large one of the same elements.
    n = 2**22
    assert c.optimizer_seconds(n, None, (2**16,) * 64) == pytest.approx(n * 40 / 1e9)
    assert c.optimizer_seconds(n, None) == c.optimizer_seconds(n, None, (n,)) == n * 100 / 1e9
    assert c.with_param("default_optimizer_impl", "fused").default_optimizer_impl == "fused"


def test_cost_model_files_are_versioned_and_old_ones_load():
    m = PRESETS["gloo-local"]
    doc = m.to_json()
    assert doc["format"] == FORMAT == 2 and "fused_bytes_per_element" in doc["compute"]
    # Format 1: no "format" key, a compute section without the step costs. It loads; its
    # one optimizer figure prices every implementation, the rest take the defaults.
    old = {k: v for k, v in doc.items() if k not in ("format", "all_gather_copies_output")}
    old["compute"] = FORMAT_1_COMPUTE
    loaded = CostModel.from_json(json.loads(json.dumps(old)))
    c = loaded.compute
    assert c.optimizer_bytes("fused") == c.optimizer_bytes("foreach") == 120.0
    assert c.norm_fp32_bytes_per_element == 4.0 and c.param_overhead_us == 0.0
    assert not loaded.all_gather_copies_output
    for bad in (3, "2", True):
        with pytest.raises(CostModelError, match="format .* is not one this evenzero reads"):
            CostModel.from_json({**doc, "format": bad})


def test_presets_step_costs():
    cpu = PRESETS["gloo-local"].compute
    gpu = PRESETS["h100-nvlink-8"].compute
    assert cpu.default_optimizer_impl == "single_tensor" and gpu.default_optimizer_impl == "foreach"
    for c in (cpu, gpu):
        assert c.optimizer_bytes("fused") < c.optimizer_bytes("foreach") <= c.optimizer_bytes(
            "single_tensor")
        assert c.norm_fp32_bytes_per_element < c.norm_fp64_bytes_per_element
        assert c.param_overhead_us < c.tensor_overhead_us
    assert gpu.optimizer_bytes("fused") == 28.0  # 7 fp32 streams
    assert PRESETS["gloo-local"].all_gather_copies_output
    assert not PRESETS["h100-nvlink-8"].all_gather_copies_output


def test_variants_measured_at_a_size_price_only_that_size():
    exact = Variant("m2", 100.0, 1.0, group_size=2)
    generic = Variant("m", 800.0, 1.0, scaling="linear", step_us=50.0)
    op = OpCost((exact, generic))
    m = CostModel("x", "", op, op, op, op, reference_ranks=8)
    assert m.choose("reduce", 2, 0) == (exact, pytest.approx(100e-6))
    assert m.choose("reduce", 8, 0)[1] == pytest.approx(800e-6)
    assert m.choose("reduce", 16, 0)[1] == pytest.approx((800 + 8 * 50) * 1e-6)
    assert m.choose("reduce", 4, 0)[1] == pytest.approx((800 - 4 * 50) * 1e-6)
    with pytest.raises(CostModelError, match="without max_bytes or group_size"):
        OpCost((exact,))
    with pytest.raises(CostModelError, match="group_size must be None or an integer >= 2"):
        Variant("bad", 1.0, 1.0, group_size=1)


def test_fit_model_across_group_sizes():
    from evenzero.cost.fit import fit_model

    def line(n):  # alpha grows 100 us per rank; 2 GB/s everywhere
        return lambda op, s: (200 + 100 * n) * 1e-6 + s / 2e9
    samples = [Sample(op, n, s, line(n)(op, s)) for n in (2, 4, 8) for op in OPS
               for s in (4096, 2**20, 2**24)]
    compute = DeviceCompute("c", tflops=0.1, memory_gbs=5.0)
    m = fit_model(samples, "fit", compute=compute, rs_variant="all_to_all+sum")
    assert m.reference_ranks == 8 and m.fitted_ranks == (8,) and m.compute == compute
    for s in samples:
        assert m.time(s.op, s.group_size, s.nbytes) == pytest.approx(s.seconds, rel=1e-6)
    # Other sizes follow the line through the measured latencies.
    v, _ = m.choose("all_gather", 16, 0)
    assert v.group_size is None and m.alpha_us(v, 16) == pytest.approx(1800, rel=1e-6)
    assert m.choose("reduce_scatter", 2, 4)[0].name == "all_to_all+sum"
    assert m.extrapolation_warning(16) and m.extrapolation_warning(8) is None
    # Timings that do not grow with size at one group size: that size falls back to the line.
    noisy = [s if s.group_size != 4 else Sample(s.op, 4, s.nbytes, 1e-3) for s in samples]
    fallback = fit_model(noisy, "noisy")
    assert fallback.op("reduce").measured_sizes() == {2, 8}
    with pytest.raises(CostModelError, match="did not grow"):
        fit_model([Sample(op, 2, s, 1e-3) for op in OPS for s in (4096, 2**20)])


def test_spec_compute_fields_round_trip_and_validate():
    doc = {"params": [{"name": "e", "shape": [10, 4], "layer": "embedding"},
                      {"name": "w", "shape": [4, 4], "token_share": 0.5,
                       "extra_backward_flops_per_token": 12}],
           "tokens": 64}
    spec = from_json(doc)
    assert spec.tokens == 64 and spec.param("e").layer == "embedding"
    assert spec.param("w").token_share == 0.5 and spec.param("w").extra_backward_flops_per_token == 12
    again = from_json(spec.to_json())
    assert again.params == spec.params and again.tokens == 64
    assert spec.with_arrival(["w", "e"]).tokens == 64  # re-planning keeps the tokens
    for bad, needle in (({"tokens": 0}, "tokens: expected a positive integer"),
                        ({"params": [{"name": "e", "shape": [1], "layer": "conv"}]}, ".layer"),
                        ({"params": [{"name": "e", "shape": [1], "token_share": 2}]},
                         ".token_share")):
        with pytest.raises(SpecError, match=needle):
            from_json({**doc, **bad})


def test_presets_carry_tokens_and_layer_kinds():
    gpt = preset("gpt2-xl")
    assert gpt.tokens == 1024 and gpt.param("embed.weight").layer == "embedding"
    assert gpt.param("layers.0.attn.qkv.bias").extra_backward_flops_per_token == 4 * 1024 * 1600
    seed = preset("seed-moe-gate-lost")
    assert seed.tokens == 32 and seed.param("moe.experts.0.fc1.weight").token_share == 0.25
