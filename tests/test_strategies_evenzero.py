"""The evenzero planner: the seed case, and properties over random models (no tensors)."""

from __future__ import annotations

import dataclasses

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from evenzero.model_presets import preset
from evenzero.plan import Plan
from evenzero.spec import DTYPE_BYTES, GroupSpec, ModelSpec, ParamSpec
from evenzero.strategies import PlanOptions
from evenzero.strategies import plan as make_plan
from evenzero.strategies.evenzero import plan_evenzero

ALIGN_BYTES = 128


def assert_every_element_owned_once(spec: ModelSpec, p: Plan) -> None:
    """Walk every rank's shard of every group; each element of each param exactly once."""
    covered: dict[str, list[tuple[int, int]]] = {}
    for g in p.groups:
        shard = p.shard_numel(g.name)
        for rank in range(g.size):
            runs = p.shard_ranges(g.name, rank)
            for r in runs:
                assert r.rank == rank and r.numel > 0
                assert 0 <= r.shard_offset and r.shard_offset + r.numel <= shard
                covered.setdefault(r.param, []).append((r.start, r.start + r.numel))
    for param in spec.params:
        runs = sorted(covered.get(param.name, []))
        if param.numel == 0:
            assert runs == []
            continue
        pos = 0
        for lo, hi in runs:
            assert lo == pos, f"{param.name}: gap or overlap at {pos} (next run starts at {lo})"
            pos = hi
        assert pos == param.numel, f"{param.name}: owned {pos} of {param.numel} elements"


# --------------------------------------------------------------------------- seed case


ONE_BUCKET_PER_GROUP = PlanOptions(bucket_numel=2**25)


def test_seed_moe_is_two_equal_reduce_scatters():
    spec = preset("seed-moe")
    p = make_plan(spec, 8, "evenzero", ONE_BUCKET_PER_GROUP)
    backward = p.backward()
    assert [(c.op, c.group, c.group_size) for c in backward] == [
        ("reduce_scatter", "experts", 2), ("reduce_scatter", "dense", 8)]
    for c in backward:
        bucket = next(b for b in p.buckets if (b.group, b.index) == (c.group, c.bucket))
        assert c.numel == bucket.numel and c.offset == 0 and c.root is None
        assert bucket.numel % c.group_size == 0
    # Equal shards: 2,018,000 dense elements padded to 2,018,048 = 8 x 252,256.
    assert p.shard_numel("dense") == 252_256 and p.shard_numel("experts") == 4_004_000
    assert {len(p.shard_ranges("dense", r)) > 0 for r in range(8)} == {True}
    assert_every_element_owned_once(spec, p)


def test_seed_moe_gate_lost_still_owns_the_gate():
    spec = preset("seed-moe-gate-lost")
    p = plan_evenzero(spec, 8, ONE_BUCKET_PER_GROUP)
    assert len(p.backward()) == 2
    dense = p.group_buckets("dense")[0]
    assert dense.params[-1].name == "moe.gate.wg.weight"  # never arrives: laid out last
    assert any("no gradient" in n for n in p.notes)
    assert_every_element_owned_once(spec, p)


# --------------------------------------------------------------------------- properties


@st.composite
def models(draw) -> tuple[ModelSpec, int, PlanOptions]:
    world = draw(st.integers(1, 64))
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    n_expert_groups = draw(st.integers(0, 2))
    groups = [GroupSpec("dense")] + [GroupSpec(f"experts{i}", draw(st.sampled_from(divisors)))
                                     for i in range(n_expert_groups)]
    dtype = {g.name: draw(st.sampled_from(sorted(DTYPE_BYTES))) for g in groups}
    n_params = draw(st.integers(1, 24))
    params = []
    for i in range(n_params):
        group = draw(st.sampled_from(groups)).name
        shape = tuple(draw(st.lists(st.integers(0, 300), min_size=1, max_size=3)))
        params.append(ParamSpec(f"p{i}", shape, group, dtype[group]))
    names = [p.name for p in params]
    arrival = draw(st.permutations(names))
    arrival = arrival[:draw(st.integers(0, len(arrival)))]  # a suffix never arrives
    bucket = draw(st.one_of(st.just("auto"), st.integers(1, 100_000)))
    return ModelSpec(tuple(params), tuple(groups), tuple(arrival)), world, PlanOptions(bucket)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(models())
def test_evenzero_plan_properties(case):
    spec, world, options = case
    p = plan_evenzero(spec, world, options)
    auto_numel = None
    if options.fixed_bucket_numel is None:
        # The auto plan is the fixed plan of the size it chose, and says which.
        from evenzero.cost.autobucket import choose_bucket_numel
        from evenzero.cost.presets import PRESETS, default_cost_preset
        from evenzero.strategies.evenzero import plan_fixed

        def cut(numel):
            return plan_fixed(spec, world, dataclasses.replace(options, bucket_numel=numel))

        choice = choose_bucket_numel(spec, PRESETS[default_cost_preset(world)], cut,
                                     memory_budget=options.bucket_memory_bytes,
                                     reduce_dtype=options.reduce_dtype)
        auto_numel = choice.numel
        assert p.buckets == choice.plan.buckets and p.collectives == choice.plan.collectives
        assert p.notes[-1] == choice.note and f"{auto_numel:,} elements" in choice.note
    size = {g.name: g.size for g in p.groups}
    pos = {n: i for i, n in enumerate(spec.arrival_order)}
    never = len(pos)

    # Layouts are the buckets, and each bucket is reduced by exactly one reduce-scatter.
    assert p.layouts == p.buckets
    backward = p.backward()
    assert len(backward) == len(p.buckets)
    for c, b in zip(backward, p.buckets, strict=True):
        assert (c.op, c.group, c.bucket, c.offset, c.numel, c.root) == (
            "reduce_scatter", b.group, b.index, 0, b.numel, None)
        assert c.group_size == size[b.group]

    for g in p.groups:
        itemsize = DTYPE_BYTES[spec.group_params(g.name)[0].dtype]
        align = max(1, ALIGN_BYTES // itemsize)
        limit = options.fixed_bucket_numel or auto_numel
        buckets = sorted(p.group_buckets(g.name), key=lambda b: b.index)
        assert [b.index for b in buckets] == list(range(len(buckets)))
        for b in buckets:
            # Padded to group size x alignment: equal shards that start 128-byte aligned.
            assert b.numel % (g.size * align) == 0
            per = b.numel // g.size
            assert (per * itemsize) % ALIGN_BYTES == 0 or ALIGN_BYTES < itemsize
            assert b.used <= b.numel < b.used + g.size * align
            # Slots are contiguous from 0; a param over the limit sits alone.
            offset = 0
            for s in b.params:
                assert s.offset == offset and s.numel == spec.param(s.name).numel > 0
                offset += s.numel
            assert b.used <= limit or len(b.params) == 1
        # No param split, none lost: the group's params in arrival order, then the missing.
        laid_out = [s.name for b in buckets for s in b.params]
        arrived = sorted((q.name for q in spec.group_params(g.name) if q.name in pos), key=pos.get)
        missing = [q.name for q in spec.group_params(g.name) if q.name not in pos]
        assert laid_out == [n for n in arrived + missing if spec.param(n).numel > 0]
        # Greedy cut: a bucket closes only because the next param would overflow it.
        for b, nxt in zip(buckets, buckets[1:], strict=False):
            assert b.used + nxt.params[0].numel > limit

    # Issue order: a bucket is reduced when its last gradient arrives.
    ready = [max(pos.get(s.name, never) for s in b.params) for b in p.buckets]
    assert ready == sorted(ready)
    assert_every_element_owned_once(spec, p)
    assert p.padding() == sum(b.numel - b.used for b in p.buckets)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 8), st.integers(1, 4096))
def test_every_rank_slice_starts_128_byte_aligned_in_its_flat_shard(world, numel):
    spec = ModelSpec((ParamSpec("a", (numel,), dtype="bfloat16"),
                      ParamSpec("b", (numel + 3,), dtype="bfloat16")))
    p = plan_evenzero(spec, world, PlanOptions(bucket_numel=numel))
    for rank in range(world):
        for r in p.shard_ranges("dense", rank):
            per = p.group_layouts("dense")[r.layout].numel // world
            into_slice = r.layout_offset - rank * per
            assert 0 <= into_slice < per
            # Where this layout's slice begins, in the layout and in the flat shard.
            assert (rank * per * 2) % ALIGN_BYTES == 0
            assert ((r.shard_offset - into_slice) * 2) % ALIGN_BYTES == 0


def test_empty_model_is_a_plan_error():
    from evenzero.plan import PlanError
    from evenzero.spec import ModelSpec
    from evenzero.strategies import plan

    try:
        plan(ModelSpec(()), 4, "evenzero")
    except PlanError as e:
        assert "no trainable parameters" in str(e)
    else:
        raise AssertionError("an empty model was planned")


# --------------------------------------------------------------------------- runtime settings


def _mixed() -> ModelSpec:
    """An fp32 group and a bf16 group, 1000 elements each."""
    return ModelSpec((ParamSpec("a", (1000,)), ParamSpec("b", (1000,), dtype="bfloat16", group="half")),
                     groups=(GroupSpec("dense"), GroupSpec("half")))


def test_stage_and_forward_gather_reach_the_plan_and_its_memory():
    from evenzero.cost.memory import estimate_memory
    from evenzero.plan import GradsAtRest

    spec = _mixed()
    two = plan_evenzero(spec, 4, PlanOptions(bucket_numel=600))
    one = plan_evenzero(spec, 4, PlanOptions(bucket_numel=600, stage=1))
    assert two.execution.copies_grads and not two.execution.overlap_param_gather
    assert one.memory.grads_at_rest is GradsAtRest.BUFFERS_AND_SHARD
    assert not one.execution.copies_grads  # gradients land in the buffers
    shard = sum(two.shard_numel(g.name) for g in two.groups)
    m2, m1 = estimate_memory(two), estimate_memory(one)
    assert m2.grad_bytes == 4 * shard and m2.inflight_bytes > 0
    # Stage 1 holds every bucket in the parameter dtype as well as the fp32 shard, and
    # nothing in flight when no bucket is cast to another reduce dtype.
    buffers = sum(b.numel * (4 if b.group == "dense" else 2) for b in one.buckets)
    assert m1.grad_bytes == buffers + 4 * shard and m1.inflight_bytes == 0
    cast = plan_evenzero(spec, 4, PlanOptions(bucket_numel=600, stage=1, reduce_dtype="float32"))
    assert cast.execution.copies_grads and estimate_memory(cast).inflight_bytes > 0
    gathered = plan_evenzero(spec, 4, PlanOptions(bucket_numel=600, overlap_param_gather=True))
    assert gathered.execution.overlap_param_gather
    assert gathered.collectives == two.collectives


def test_fp32_masters_are_the_parameters_own_memory():
    from evenzero.cost.memory import estimate_memory

    spec = _mixed()
    p = plan_evenzero(spec, 4, PlanOptions(bucket_numel=600))
    shard = {g.name: p.shard_numel(g.name) for g in p.groups}
    assert p.memory.aliased_groups == ("dense",)
    # Adam's two fp32 states everywhere; a separate fp32 master only for the bf16 group:
    # 4 bytes per parameter over N less than a copy for every group.
    assert estimate_memory(p).optimizer_bytes == 8 * shard["dense"] + 12 * shard["half"]
    assert p.step_work.copy_bytes == 2 * shard["half"] * (4 + 2)
    wide = plan_evenzero(spec, 4, PlanOptions(bucket_numel=600, master_dtype="float64"))
    assert wide.memory.aliased_groups == () and wide.memory.master_itemsize == 8
    assert estimate_memory(wide).optimizer_bytes == 24 * (shard["dense"] + shard["half"])
    assert "64-bit grad shard" in estimate_memory(wide).basis


def test_the_optimizer_implementation_and_norm_reach_the_step_work():
    spec = _mixed()
    default = plan_evenzero(spec, 4, PlanOptions(bucket_numel=600))
    chosen = plan_evenzero(spec, 4, PlanOptions(bucket_numel=600, optimizer_impl="foreach"))
    assert default.step_work.optimizer_impl == "fused" and default.step_work.norm == "fp32"
    assert chosen.step_work.optimizer_impl == "foreach"
    elements = sum(default.shard_numel(g.name) for g in default.groups)
    assert default.step_work.optimizer_elements == default.step_work.norm_elements == elements
    assert default.step_work.optimizer_tensor_numels == tuple(
        default.shard_numel(g.name) for g in default.groups)  # one flat shard per group
    assert default.step_work.optimizer_tensors == 2 and default.step_work.params == 2


# ---------------------------------------------------------------------- offload (issue 26)


def test_offload_moves_optimizer_memory_to_the_host_and_counts_the_link():
    from evenzero.cost.memory import estimate_memory
    from evenzero.model_presets import preset
    from evenzero.strategies import PlanOptions, plan

    spec = preset("gpt2-xl")
    plain = plan(spec, 2, "evenzero", PlanOptions(bucket_numel=1 << 24))
    off = plan(spec, 2, "evenzero", PlanOptions(bucket_numel=1 << 24, offload_optimizer="cpu"))
    a, b = estimate_memory(plain), estimate_memory(off)
    shard = sum(off.shard_numel(g.name) for g in off.groups)
    assert b.optimizer_bytes == 0 and b.grad_bytes == 0 and b.inflight_bytes == a.inflight_bytes
    # masters + Adam's two states + the gradient shard, in fp32, plus the staging
    assert b.host_bytes >= shard * 16 and b.host_bytes < shard * 16 * 1.3
    work = off.step_work
    assert work.host_step and work.copy_bytes == 0
    assert work.host_link_backward_bytes == shard * 4
    param_bytes = {g.name: 2 if g.dtype == "bfloat16" else 4 for g in off.groups}
    assert work.host_link_bytes == sum(2 * off.shard_numel(g.name) * param_bytes[g.name]
                                       for g in off.groups)
    assert not plain.step_work.host_step and plain.step_work.host_link_bytes == 0


def test_plan_offload_says_where_it_fits_and_what_it_costs(capsys):
    from evenzero import cli

    assert cli.main(["plan", "llama-7b", "--world-size", "1", "--strategy", "evenzero",
                     "--offload", "--cost", "h100-nvlink-8"]) == 0
    out = capsys.readouterr().out
    assert "verdict: offload fits where plain ZeRO does not" in out
    assert "across the host link per step" in out and "with offload (" in out
