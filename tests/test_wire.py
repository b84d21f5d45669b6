"""`grad_compression` in the planner: wire bytes, alignment, refusals, memory and cost.

No processes: the plan is pure data (`evenzero.wire`, `strategies/evenzero.py`).
"""

from __future__ import annotations

import pytest

from evenzero.cost.compute import estimate_profile
from evenzero.cost.memory import estimate_memory
from evenzero.cost.presets import PRESETS
from evenzero.cost.timeline import simulate
from evenzero.model_presets import seed_moe
from evenzero.plan import PlanError
from evenzero.spec import ModelSpec, ParamSpec
from evenzero.strategies.common import PlanOptions
from evenzero.strategies.evenzero import plan_evenzero
from evenzero.wire import DEFAULT_BLOCK, codec_traffic, wire_bytes


def _plan(mode, world=8, spec=None, **kw):
    return plan_evenzero(spec or seed_moe(), world,
                         PlanOptions(bucket_numel=2**20, grad_compression=mode, **kw))


def _backward_bytes(plan) -> int:
    return sum(c.nbytes for c in plan.backward() if c.group_size > 1)


def test_wire_bytes_per_mode():
    assert wire_bytes(None, 1024, 4) == 4096
    assert wire_bytes("bf16", 1024, 4) == 2048
    assert wire_bytes("int8", 1024, 4, 256) == 1024 + 4 * 4
    assert 4 / (1 + 4 / DEFAULT_BLOCK) == pytest.approx(3.94, abs=0.01)


def test_plan_shows_compressed_collectives_and_their_bytes():
    exact, bf16, int8 = _plan(None), _plan("bf16"), _plan("int8")
    assert all(c.compression is None for c in exact.backward())
    assert {c.compression for c in bf16.backward()} == {"bf16"}
    assert {(c.compression, c.block_numel) for c in int8.backward()} == {("int8", DEFAULT_BLOCK)}
    # still one equal reduce-scatter per bucket
    assert [c.op for c in int8.backward()] == ["reduce_scatter"] * len(int8.buckets)
    assert _backward_bytes(exact) / _backward_bytes(bf16) == pytest.approx(2.0, rel=1e-3)
    assert _backward_bytes(exact) / _backward_bytes(int8) == pytest.approx(3.93, abs=0.02)
    assert "1+4/256 int8" in str(int8.backward())
    # the step's gathers carry parameters, uncompressed
    assert [c.nbytes for c in int8.step()][1:] == [c.numel * 4 for c in int8.step()][1:]


def test_int8_chunks_hold_whole_blocks():
    plan = _plan("int8", compression_block=1024)
    for b in plan.buckets:
        assert (b.numel // plan.group(b.group).size) % 1024 == 0


@pytest.mark.parametrize("block", [0, 48, 16, 1 << 17, True, 256.0])
def test_bad_block_size_names_the_setting(block):
    with pytest.raises(PlanError, match="grad_compression_block"):
        PlanOptions(grad_compression="int8", compression_block=block)


def test_unknown_mode_and_feedback_without_compression_are_refused():
    with pytest.raises(PlanError, match="grad_compression"):
        PlanOptions(grad_compression="fp8")
    with pytest.raises(PlanError, match="grad_compression"):
        PlanOptions(error_feedback=True)


def test_int8_refuses_float64_by_name():
    spec = seed_moe(dtype="float64")
    with pytest.raises(PlanError, match='grad_compression="int8".*float64'):
        _plan("int8", spec=spec)
    _plan("bf16", spec=spec)  # bf16 of fp64 gradients is allowed, summed in fp64


def test_group_of_one_is_a_note_not_an_error():
    dense = ModelSpec((ParamSpec("w", (64, 64)),))
    plan = _plan("int8", world=1, spec=dense, error_feedback=True)
    assert all(c.compression is None for c in plan.backward())
    assert any("does nothing" in n and "group of one" in n for n in plan.notes)
    assert estimate_memory(plan).residual_bytes == 0
    # experts over 4 ranks at world 4: one rank per expert group, dense compressed
    mixed = _plan("bf16", world=4)
    sizes = {g.name: g.size for g in mixed.groups}
    assert {c.group for c in mixed.backward() if c.compression} == {
        g for g, n in sizes.items() if n > 1}
    assert any("experts" in n for n in mixed.notes)


def test_error_feedback_memory_is_planned():
    plain, ef = _plan("int8"), _plan("int8", error_feedback=True)
    compressed = sum(c.numel for c in ef.backward() if c.compression)
    assert ef.memory.residual_numel == compressed
    assert estimate_memory(ef).residual_bytes == 4 * compressed
    assert estimate_memory(ef).total_bytes == estimate_memory(plain).total_bytes + 4 * compressed
    assert estimate_memory(plain).inflight_bytes > estimate_memory(_plan(None)).inflight_bytes


def test_timeline_charges_codec_and_less_wire_time():
    spec = ModelSpec(tuple(ParamSpec(f"w{i}", (1024, 1024)) for i in range(8)), tokens=512)
    cost = PRESETS["gloo-local"]
    profile = estimate_profile(spec, cost.compute)
    runs = {m: simulate(plan_evenzero(spec, 4, PlanOptions(bucket_numel=2**21, grad_compression=m)),
                        cost, profile) for m in (None, "bf16", "int8")}
    kinds = {m: {s.kind for s in t.segments} for m, t in runs.items()}
    assert "encode" in kinds["int8"] and "decode" in kinds["int8"]
    assert runs["int8"].backward_comm_s < runs["bf16"].backward_comm_s < runs[None].backward_comm_s
    enc, dec = codec_traffic("int8", 1 << 20, 4, 4)
    enc_ef, _ = codec_traffic("int8", 1 << 20, 4, 4, error_feedback=True)
    assert enc > 0 and dec > 0 and enc_ef > enc
