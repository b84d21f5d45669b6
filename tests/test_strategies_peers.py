"""Megatron, FSDP2 and DDP planners, and properties every peer planner must keep."""

import math
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from evenzero.model_presets import preset
from evenzero.plan import PlanError
from evenzero.spec import GroupSpec, ModelSpec, ParamSpec
from evenzero.strategies import PlanOptions, plan
from evenzero.strategies.deepspeed import DEFAULT_REDUCE_BUCKET_SIZE, plan_deepspeed_reduce_mode
from evenzero.strategies.deepspeed_layout import IPG_GROUP
from evenzero.strategies.fsdp2 import ROOT_UNIT, padded_numel, unit_prefix
from evenzero.strategies.megatron import default_bucket_numel

PEERS = ("deepspeed-0.6", "deepspeed", "megatron", "fsdp2", "ddp")
SHARDED = ("deepspeed-0.6", "deepspeed", "megatron", "fsdp2")


DENSE_ONLY = (GroupSpec("dense"),)


def spec_of(shapes, arrival=None, groups=DENSE_ONLY, group_of=None, dtype="float32"):
    group_of = group_of or {}
    params = tuple(ParamSpec(n, s, group_of.get(n, "dense"), dtype) for n, s in shapes.items())
    return ModelSpec(params, groups, tuple(arrival) if arrival is not None else None)


# --------------------------------------------------------------------------- Megatron


def test_megatron_aligns_param_starts_and_pads_bucket_ends():
    # Reverse registration: c, b, a. c=[0,1000); b starts at 1024 and ends 1034 >= 1030,
    # so the bucket closes after b, padded to lcm(2, 128) = 128 -> 1152; a goes alone.
    spec = spec_of({"a": (100,), "b": (10,), "c": (1000,)}, arrival=["a", "c", "b"])
    p = plan(spec, 2, "megatron", PlanOptions(bucket_numel=1030))
    assert [(b.index, b.numel, [(s.name, s.offset) for s in b.params]) for b in p.layouts] == [
        (0, 1152, [("c", 0), ("b", 1024)]), (1, 128, [("a", 0)])]
    # Bucket 1 (a) completes first in this arrival order.
    assert [(c.op, c.bucket, c.numel) for c in p.backward()] == [
        ("reduce_scatter", 1, 128), ("reduce_scatter", 0, 1152)]
    assert [(c.op, c.buffer_index) for c in p.step()] == [("all_gather", 0), ("all_gather", 1)]
    assert p.buckets == tuple(sorted(p.layouts, key=lambda b: -b.index))
    assert any("full-size" in n for n in p.notes)


def test_megatron_default_bucket_grows_with_the_group():
    assert default_bucket_numel(8) == 40_000_000
    assert default_bucket_numel(128) == 128_000_000


def test_megatron_seed_case_has_one_bucket_per_group():
    p = plan(preset("seed-moe"), 8, "megatron")
    assert [(c.group, c.group_size, c.numel) for c in p.backward()] == [
        ("experts", 2, 8_008_192), ("dense", 8, 2_018_048)]
    assert all(c.numel % math.lcm(c.group_size, 128) == 0 for c in p.backward())


def test_megatron_messages_use_the_param_dtype():
    p = plan(preset("llama-7b"), 8, "megatron")
    assert {c.itemsize for c in p.backward()} == {2}
    assert len(p.backward()) > 1


# --------------------------------------------------------------------------- FSDP2


def test_fsdp2_unit_rule():
    assert unit_prefix("layers.3.attn.q.weight") == "layers.3"
    assert unit_prefix("moe.experts.2.fc1.bias") == "moe.experts.2"
    assert unit_prefix("h.11.mlp.c_fc.weight") == "h.11"
    assert unit_prefix("fc1.weight") == ROOT_UNIT
    assert unit_prefix("embed.weight") == ROOT_UNIT


def test_fsdp2_pads_dim0_per_param():
    assert padded_numel((10, 3), 4) == 36
    assert padded_numel((8, 3), 4) == 24
    assert padded_numel((), 4) == 4
    spec = spec_of({"layers.0.w": (10, 3), "layers.0.b": (5,), "head.w": (2, 2)})
    p = plan(spec, 4, "fsdp2")
    # w: c = ceil(10/4) = 3 rows (9 elements) per rank, rank 3 owns only row 9.
    # b: c = 2, rank 2 owns element 4 only. head.w: c = 1 row, ranks 2 and 3 own padding.
    assert [(r.param, r.start, r.numel) for r in p.shard_ranges("dense", 3)] == [
        ("layers.0.w", 27, 3)]
    assert [(r.param, r.start, r.numel) for r in p.shard_ranges("dense", 2)] == [
        ("layers.0.w", 18, 9), ("layers.0.b", 4, 1)]
    assert [(r.param, r.start, r.numel) for r in p.shard_ranges("dense", 1)] == [
        ("layers.0.w", 9, 9), ("layers.0.b", 2, 2), ("head.w", 2, 2)]
    assert p.shard_numel("dense") == 9 + 2 + 2
    assert [(c.bucket, c.numel) for c in p.backward()] == [(0, 36 + 8), (1, 8)]


def test_fsdp2_root_reduces_last_and_gathers_first():
    spec = spec_of({"embed": (4,), "layers.0.w": (4,), "layers.1.w": (4,), "head": (4,)},
                   arrival=["head", "layers.1.w", "embed", "layers.0.w"])
    p = plan(spec, 2, "fsdp2")
    names = {b.index: [s.name for s in b.params] for b in p.buckets}
    assert [names[c.bucket] for c in p.backward()] == [
        ["layers.1.w"], ["layers.0.w"], ["embed", "head"]]
    assert [names[c.buffer_index] for c in p.step()] == [
        ["embed", "head"], ["layers.0.w"], ["layers.1.w"]]


def test_fsdp2_leaves_params_without_gradients_out_of_the_reduce_scatter():
    full = plan(preset("seed-moe"), 8, "fsdp2")
    lost = plan(preset("seed-moe-gate-lost"), 8, "fsdp2")
    assert [(c.group, c.group_size, c.numel) for c in full.backward()] == (
        [("experts", 2, 2_002_000)] * 4 + [("dense", 8, 2_018_000)])
    assert lost.backward()[-1].numel == 2_002_000
    assert len(full.step()) == 5


# --------------------------------------------------------------------------- DDP


def test_ddp_first_bucket_is_1_mib_then_25_mib():
    shapes = {f"p{i}": (100_000,) for i in range(10)}  # 400 kB each in fp32
    p = plan(spec_of(shapes), 1, "ddp")
    # Arrival is reverse registration: p9 first. 3 x 400 kB >= 1 MiB closes bucket 0.
    assert [[s.name for s in b.params] for b in p.buckets] == [
        ["p9", "p8", "p7"], ["p6", "p5", "p4", "p3", "p2", "p1", "p0"]]
    assert [c.numel for c in p.backward()] == [300_000, 700_000]
    assert not p.sharded and p.layouts == () and p.step() == ()


def test_ddp_user_bucket_size_applies_to_the_first_bucket_too():
    shapes = {f"p{i}": (100_000,) for i in range(10)}
    p = plan(spec_of(shapes), 1, "ddp", PlanOptions(bucket_numel=250_000))
    assert [c.numel for c in p.backward()] == [300_000, 300_000, 300_000, 100_000]


def test_ddp_with_unused_params_buckets_reverse_registration_order():
    shapes = {f"p{i}": (100_000,) for i in range(10)}
    arrival = [f"p{i}" for i in range(9, 0, -1)]  # p0 never gets a gradient
    p = plan(spec_of(shapes, arrival), 1, "ddp")
    # Cut over registration order (p0 p1 p2 | p3..p9), then the list is reversed.
    assert [[s.name for s in b.params] for b in p.buckets] == [
        ["p3", "p4", "p5", "p6", "p7", "p8", "p9"], ["p0", "p1", "p2"]]
    assert any("find_unused_parameters=True" in n for n in p.notes)


def test_ddp_is_expert_aware():
    p = plan(preset("seed-moe"), 8, "ddp")
    by_group = {g: sum(c.numel for c in p.backward() if c.group == g) for g in ("dense", "experts")}
    assert by_group == {"dense": 2_018_000, "experts": 8_008_000}
    assert {c.group_size for c in p.backward() if c.group == "experts"} == {2}
    assert all(c.op == "all_reduce" for c in p.backward())


# --------------------------------------------------------------------------- all peers


@pytest.mark.parametrize("strategy", PEERS)
def test_peers_reject_bad_input(strategy):
    with pytest.raises(PlanError, match="multiple of 4"):
        plan(preset("seed-moe"), 6, strategy)
    with pytest.raises(PlanError, match="no trainable parameters"):
        plan(ModelSpec(()), 2, strategy)
    with pytest.raises(PlanError, match="mixes parameter dtypes"):
        plan(ModelSpec((ParamSpec("a", (4,)), ParamSpec("b", (4,), dtype="bfloat16"))), 2, strategy)


@pytest.mark.parametrize("strategy", ("megatron", "fsdp2", "ddp"))
def test_llama_70b_on_1024_ranks_plans_fast(strategy):
    spec = preset("llama-70b")
    start = time.perf_counter()
    plan(spec, 1024, strategy)
    elapsed = time.perf_counter() - start
    assert elapsed < 2.0, f"{strategy} took {elapsed:.2f}s"


PREFIXES = ("layers.0.", "layers.1.", "blocks.2.mlp.", "", "head.")


@st.composite
def specs(draw):
    """Small dense+expert models with random shapes, prefixes and (partial) arrival."""
    e = draw(st.sampled_from([1, 2, 4]))
    world = e * draw(st.integers(1, 4))
    shape = st.lists(st.integers(0, 37), min_size=0, max_size=2).map(tuple)
    params = []
    for i in range(draw(st.integers(1, 7))):
        params.append(ParamSpec(f"{draw(st.sampled_from(PREFIXES))}d{i}", draw(shape)))
    for i in range(draw(st.integers(0, 5))):
        params.append(ParamSpec(f"moe.experts.{draw(st.integers(0, 2))}.e{i}", draw(shape),
                                "experts"))
    names = [p.name for p in params]
    arrival = draw(st.permutations(names))
    dropped = draw(st.integers(0, min(2, len(names) - 1)))
    spec = ModelSpec(tuple(params), (GroupSpec("dense"), GroupSpec("experts", e)),
                     tuple(arrival[dropped:]))
    bucket = draw(st.one_of(st.none(), st.integers(1, 200)))
    return spec, world, PlanOptions(bucket_numel=bucket)


def arrived_numel(spec):
    return sum(spec.param(n).numel for n in spec.arrival_order)


@settings(max_examples=60, deadline=None)
@given(specs())
def test_every_element_is_owned_by_exactly_one_rank(case):
    spec, world, options = case
    for strategy in SHARDED:
        p = plan(spec, world, strategy, options)
        for g in p.groups:
            owned = {pp.name: [] for pp in spec.group_params(g.name)}
            for rank in range(g.size):
                ranges = p.shard_ranges(g.name, rank)
                for r in ranges:
                    owned[r.param].append((r.start, r.start + r.numel))
                    assert 0 <= r.shard_offset and r.shard_offset + r.numel <= p.shard_numel(g.name)
            for name, runs in owned.items():
                covered = 0
                for a, b in sorted(runs):
                    assert a == covered, f"{strategy}: {name} gap or overlap at {a}"
                    covered = b
                assert covered == spec.param(name).numel, f"{strategy}: {name} not fully owned"


@settings(max_examples=60, deadline=None)
@given(specs())
def test_deepspeed_reduces_cover_each_bucket_once_and_hit_the_owner(case):
    spec, world, options = case
    p = plan(spec, world, "deepspeed-0.6", options)
    back = p.backward()
    assert sum(c.numel for c in back) == arrived_numel(spec)
    size = {g.name: g.size for g in p.groups}
    for bucket in p.buckets:
        assert bucket.group == IPG_GROUP
        mine = [c for c in back if c.bucket == bucket.index]
        assert [c.offset for c in mine] == [0] + [c.offset + c.numel for c in mine[:-1]]
        assert sum(c.numel for c in mine) == bucket.numel
        for c in mine:
            assert 0 <= c.root < c.group_size == size[c.group]
            for slot in bucket.params:
                a, b = max(c.offset, slot.offset), min(c.offset + c.numel, slot.offset + slot.numel)
                if a >= b:
                    continue
                group, _, start = p.locate(slot.name)
                per = p.group_layouts(group)[0].numel // size[group]
                flat = start + a - slot.offset
                assert flat // per == (flat + b - a - 1) // per == c.root
                assert p.group(group).size == c.group_size


@settings(max_examples=60, deadline=None)
@given(specs())
def test_deepspeed_multi_rank_and_reduce_mode_move_every_arrived_element(case):
    spec, world, options = case
    limit = options.bucket_numel or DEFAULT_REDUCE_BUCKET_SIZE
    for p in (plan(spec, world, "deepspeed", options),
              plan_deepspeed_reduce_mode(spec, world, options)):
        back = p.backward()
        assert sum(c.numel for c in back) == arrived_numel(spec)
        assert all(sum(n for _, n in c.pieces()) == c.numel for c in back)
        for bucket in p.buckets:
            mine = [c for c in back if c.bucket == bucket.index]
            pieces = sorted(x for c in mine for x in c.pieces())
            assert sum(n for _, n in pieces) == bucket.numel
            if bucket.numel <= limit:
                keys = [(c.root, c.group_size, c.group) for c in mine]
                assert len(keys) == len(set(keys))


@settings(max_examples=60, deadline=None)
@given(specs())
def test_megatron_fsdp2_ddp_message_totals(case):
    spec, world, options = case
    size = {g.name: g.size for g in plan(spec, world, "ddp").groups}
    meg = plan(spec, world, "megatron", options)
    for c, b in zip(meg.backward(), meg.buckets, strict=True):
        assert c.numel == b.numel and c.numel % math.lcm(c.group_size, 128) == 0
        assert all(s.offset % 64 == 0 for s in b.params)
    assert sum(b.used for b in meg.buckets) == spec.numel
    fsdp = plan(spec, world, "fsdp2", options)
    assert sum(c.numel for c in fsdp.backward()) == sum(
        padded_numel(spec.param(n).shape, size[spec.param(n).group]) for n in spec.arrival_order)
    assert all(c.numel % c.group_size == 0 for c in fsdp.backward())
    ddp = plan(spec, world, "ddp", options)
    assert sum(c.numel for c in ddp.backward()) == spec.numel
    assert sorted(s.name for b in ddp.buckets for s in b.params) == sorted(p.name for p in spec.params)
    for g in ddp.groups:
        assert [c.bucket for c in ddp.backward() if c.group == g.name] == list(
            range(len(ddp.group_buckets(g.name))))


# --------------------------------------------------------------------------- step work


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_each_peer_plans_the_step_its_system_runs(dtype):
    spec = spec_of({"a": (64, 8), "b": (40,), "c": (16, 16)}, dtype=dtype)
    half = dtype != "float32"
    work = {name: plan(spec, 4, name).step_work for name in PEERS}
    shards = {name: sum(p.shard_numel(g.name) for g in p.groups)
              for name in SHARDED for p in [plan(spec, 4, name)]}
    # DeepSpeed: an fp64 norm copy, FusedAdam on one flat partition, the fp32 master a
    # clone even of fp32 parameters (copied back every step).
    ds = work["deepspeed"]
    assert (ds.norm, ds.optimizer_impl, ds.optimizer_tensor_numels) == (
        "fp64", "fused", (shards["deepspeed"],))
    assert ds.copy_bytes == shards["deepspeed"] * (4 + (2 if half else 4))
    # Megatron: an fp32 norm, fused Adam over each parameter's shard; only 16-bit
    # parameters have a master to copy back.
    mg = work["megatron"]
    assert (mg.norm, mg.optimizer_impl) == ("fp32", "fused")
    assert sum(mg.optimizer_tensor_numels) == shards["megatron"] and len(mg.optimizer_tensor_numels) == 3
    assert (mg.copy_bytes > 0) == half
    # FSDP2 steps the sharded parameters: no norm, no master, torch's default.
    fs = work["fsdp2"]
    assert (fs.norm, fs.optimizer_impl, fs.copy_bytes) == (None, None, 0)
    assert sum(fs.optimizer_tensor_numels) == shards["fsdp2"]
    # DDP: every parameter, whole; 16-bit ones through an fp32 master.
    dd = work["ddp"]
    assert dd.optimizer_tensor_numels == (512, 40, 256) and dd.optimizer_elements == 808
    assert (dd.norm, dd.optimizer_impl) == (None, None) and (dd.copy_bytes > 0) == half
    chosen = plan(spec, 4, "ddp", PlanOptions(optimizer_impl="fused")).step_work
    assert chosen.optimizer_impl == "fused"
