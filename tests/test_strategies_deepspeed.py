"""DeepSpeed ZeRO-2 planners against the seed case (deepspeedai/DeepSpeed#3151) and the
partitioning, IPG bucket and dispatch rules of deepspeed/runtime/zero/stage_1_and_2.py."""

import time

import pytest

from evenzero.model_presets import preset
from evenzero.plan import PlanError
from evenzero.spec import GroupSpec, ModelSpec, ParamSpec
from evenzero.strategies import PlanOptions, plan
from evenzero.strategies.deepspeed import plan_deepspeed_reduce_mode
from evenzero.strategies.deepspeed_layout import IPG_GROUP, partition_parts, round_robin_order
from evenzero.strategies.executable import split_by_group

# §8.2, in the order DeepSpeed emits them (bucket-offset order).
SEED_ROWS = [(7, 0, 1000), (3, 1000, 8000), (4, 9000, 252250), (5, 261250, 252250),
             (6, 513500, 252250), (7, 765750, 235250), (3, 1001000, 1000), (0, 1002000, 252250),
             (1, 1254250, 252250), (2, 1506500, 252250), (3, 1758750, 243250),
             (1, 2002000, 4004000), (0, 6006000, 4004000)]
# The 13 reduces printed in DeepSpeed issue #3151 (sorted by destination).
REPORTED = {(0, 1002000, 252250), (0, 6006000, 4004000), (1, 1254250, 252250),
            (1, 2002000, 4004000), (2, 1506500, 252250), (3, 1000, 8000), (3, 1001000, 1000),
            (3, 1758750, 243250), (4, 9000, 252250), (5, 261250, 252250), (6, 513500, 252250),
            (7, 0, 1000), (7, 765750, 235250)}
GATE_ROW = (7, 10010000, 16000)


def rows(p):
    return [(c.root, c.offset, c.numel) for c in p.backward()]


DENSE_ONLY = (GroupSpec("dense"),)


def spec_of(sizes, arrival=None, groups=DENSE_ONLY, group_of=None):
    group_of = group_of or {}
    params = tuple(ParamSpec(n, (k,), group_of.get(n, "dense")) for n, k in sizes.items())
    return ModelSpec(params, groups, tuple(arrival) if arrival is not None else None)


def test_seed_case_reproduces_the_13_reported_reduces():
    p = plan(preset("seed-moe-gate-lost"), 8, "deepspeed-0.6")
    back = p.backward()
    assert rows(p) == SEED_ROWS
    assert set(rows(p)) == REPORTED
    assert all(c.op == "reduce" for c in back)
    assert [c.group_size for c in back] == [8] * 11 + [2] * 2
    assert [c.group for c in back] == ["dense"] * 11 + ["experts"] * 2
    assert sum(c.numel for c in back) == 10_010_000
    assert len(p.buckets) == 1 and p.buckets[0].group == IPG_GROUP
    assert any("no gradient" in n and "moe.gate.wg.weight" in n for n in p.notes)


def test_seed_case_with_the_gate_hook_intact_adds_a_14th_reduce():
    p = plan(preset("seed-moe"), 8, "deepspeed-0.6")
    assert rows(p) == SEED_ROWS + [GATE_ROW]
    assert p.backward()[-1].group == "dense" and p.backward()[-1].group_size == 8


def test_seed_case_partition_of_rank_3_is_split_three_ways():
    p = plan(preset("seed-moe"), 8, "deepspeed-0.6")
    assert p.shard_numel("dense") == 252_250 and p.shard_numel("experts") == 4_004_000
    got = [(r.param, r.start, r.numel) for r in p.shard_ranges("dense", 3)]
    assert got == [("fc1.weight", 756_750, 243_250), ("fc1.bias", 0, 1000),
                   ("fc2.weight", 0, 8000)]
    # Those three pieces are three separate reduces to root 3.
    assert sorted(n for r, _, n in rows(p) if r == 3)[:3] == [1000, 8000, 243_250]


def test_round_robin_fragments_the_expert_entries_into_10():
    p = plan(preset("seed-moe-gate-lost"), 8, "deepspeed-0.6", PlanOptions(round_robin=True))
    experts = [c for c in p.backward() if c.group == "experts"]
    dense = [c for c in p.backward() if c.group == "dense"]
    assert len(experts) == 10
    assert sum(c.numel for c in experts) == 8_008_000
    assert {c.root for c in experts} == {0, 1}
    # 5 dense params on 8 ranks: every sub-list holds at most one param, order unchanged.
    assert [(c.root, c.offset, c.numel) for c in dense] == SEED_ROWS[:11]


def test_round_robin_order_matches_deepspeed_example():
    assert round_robin_order([str(i) for i in range(10)], 4) == \
        ["0", "4", "8", "1", "5", "9", "2", "6", "3", "7"]


def test_multi_rank_allreduce_is_one_per_process_group_per_bucket():
    p = plan(preset("seed-moe"), 8, "deepspeed")
    back = p.backward()
    assert [(c.op, c.group, c.group_size, c.numel) for c in back] == [
        ("all_reduce", "dense", 8, 2_018_000), ("all_reduce", "experts", 2, 8_008_000)]
    assert back[0].pieces() == ((0, 2_002_000), (10_010_000, 16_000))
    assert back[1].pieces() == ((2_002_000, 8_008_000),)
    lost = plan(preset("seed-moe-gate-lost"), 8, "deepspeed").backward()
    assert [c.numel for c in lost] == [2_002_000, 8_008_000]


def test_reduce_mode_concatenates_runs_per_destination():
    lost = plan_deepspeed_reduce_mode(preset("seed-moe-gate-lost"), 8).backward()
    assert [(c.root, c.group_size, c.numel) for c in lost] == (
        [(7, 8, 236_250)] + [(r, 8, 252_250) for r in (3, 4, 5, 6, 0, 1, 2)]
        + [(1, 2, 4_004_000), (0, 2, 4_004_000)])
    assert lost[1].pieces() == ((1000, 8000), (1_001_000, 1000), (1_758_750, 243_250))
    full = plan_deepspeed_reduce_mode(preset("seed-moe"), 8).backward()
    assert full[0].numel == 252_250 and full[0].pieces()[-1] == (10_010_000, 16_000)


@pytest.mark.parametrize("strategy", ["deepspeed-0.6", "deepspeed"])
def test_step_is_three_norms_then_one_all_gather_per_group(strategy):
    step = plan(preset("seed-moe"), 8, strategy).step()
    assert [(c.op, c.group, c.group_size, c.numel) for c in step] == [
        ("all_reduce", "world", 8, 1)] * 3 + [
        ("all_gather", "dense", 8, 2_018_000), ("all_gather", "experts", 2, 8_008_000)]


def test_layout_pads_to_twice_the_group_size():
    p = plan(spec_of({"a": 5, "b": 6}), 4, "deepspeed-0.6")
    (layout,) = p.layouts
    assert layout.numel == 16 and layout.padding == 5
    assert p.shard_numel("dense") == 4
    assert [(r.param, r.start, r.numel) for r in p.shard_ranges("dense", 1)] == [("a", 4, 1),
                                                                                ("b", 0, 3)]
    assert p.shard_ranges("dense", 3) == ()  # all padding


def test_param_starting_on_a_boundary_belongs_only_to_the_later_partition():
    assert partition_parts(10, 5, 10) == ((1, 0),)
    assert partition_parts(8, 5, 10) == ((0, 0), (1, 2))
    assert partition_parts(0, 30, 10) == ((0, 0), (1, 10), (2, 20))
    # a = [0, 4) = partition 0; b = [4, 8) starts exactly on partition 1.
    p = plan(spec_of({"a": 4, "b": 4}, arrival=["b", "a"]), 2, "deepspeed-0.6")
    assert rows(p) == [(1, 0, 4), (0, 4, 4)]


def test_flush_happens_before_adding_a_param_that_would_overflow():
    spec = spec_of({"a": 5, "b": 4, "c": 3}, arrival=["a", "b", "c"])
    p = plan(spec, 1, "deepspeed-0.6", PlanOptions(bucket_numel=8))
    assert [[s.name for s in b.params] for b in p.buckets] == [["a"], ["b", "c"]]
    assert [(c.bucket, c.offset, c.numel) for c in p.backward()] == [(0, 0, 5), (1, 0, 7)]


def test_a_param_exactly_the_bucket_size_still_fits():
    spec = spec_of({"a": 8, "b": 1}, arrival=["a", "b"])
    p = plan(spec, 1, "deepspeed-0.6", PlanOptions(bucket_numel=8))
    assert [[s.name for s in b.params] for b in p.buckets] == [["a"], ["b"]]
    p = plan(spec_of({"a": 7, "b": 1}, arrival=["a", "b"]), 1, "deepspeed-0.6",
             PlanOptions(bucket_numel=8))
    assert [b.numel for b in p.buckets] == [8]


def test_extra_large_param_goes_out_alone():
    spec = spec_of({"a": 3, "big": 20, "c": 2}, arrival=["a", "big", "c"])
    p = plan(spec, 1, "deepspeed-0.6", PlanOptions(bucket_numel=10))
    assert [[s.name for s in b.params] for b in p.buckets] == [["a"], ["big"], ["c"]]
    assert any("exceed" in n for n in p.notes)


def test_all_reduce_chunks_close_after_exceeding_the_bucket_size():
    # One 40-element param over 4 ranks: entries of 10 for dst 0..3, bucket size 15.
    spec = spec_of({"big": 40})
    ar = plan(spec, 4, "deepspeed", PlanOptions(bucket_numel=15)).backward()
    assert [(c.offset, c.numel) for c in ar] == [(0, 20), (20, 20)]
    red = plan_deepspeed_reduce_mode(spec, 4, PlanOptions(bucket_numel=15)).backward()
    assert [(c.root, c.numel) for c in red] == [(0, 10), (1, 10), (2, 10), (3, 10)]


def test_zero_size_params_are_skipped():
    spec = ModelSpec((ParamSpec("a", (4,)), ParamSpec("empty", (0, 3)), ParamSpec("b", (4,))))
    p = plan(spec, 2, "deepspeed-0.6")
    assert [s.name for s in p.buckets[0].params] == ["b", "a"]
    assert sum(c.numel for c in p.backward()) == 8


def _seam_spec(second_group: GroupSpec):
    # dense x|y|z on 4 ranks (partition size 2): x->0, y->1, z->2,3.
    # e0|e1 in `second_group`: with E=2 the EDP group has 2 ranks: e0->0, e1->1.
    groups = (GroupSpec("dense"), second_group)
    sizes = {"x": 2, "y": 2, "z": 4, "e0": 2, "e1": 2}
    group_of = {"e0": second_group.name, "e1": second_group.name}
    return spec_of(sizes, ["y", "e1", "x", "e0", "z"], groups, group_of)


def test_adjacent_runs_to_the_same_dst_on_different_process_groups_do_not_merge():
    p = plan(_seam_spec(GroupSpec("experts", 2)), 4, "deepspeed-0.6")
    assert [(c.root, c.offset, c.numel, c.group, c.group_size) for c in p.backward()] == [
        (1, 0, 2, "dense", 4), (1, 2, 2, "experts", 2), (0, 4, 2, "dense", 4),
        (0, 6, 2, "experts", 2), (2, 8, 2, "dense", 4), (3, 10, 2, "dense", 4)]


def test_adjacent_runs_to_the_same_dst_on_the_same_process_group_merge_across_groups():
    # A second plain param group (e.g. no-weight-decay) shares the DP process group.
    p = plan(_seam_spec(GroupSpec("nodecay")), 4, "deepspeed-0.6")
    # nodecay: e0|e1 on 4 ranks padded to 8 -> partition size 2: e0->0, e1->1.
    assert [(c.root, c.offset, c.numel, c.group) for c in p.backward()] == [
        (1, 0, 4, "dense"), (0, 4, 4, "dense"), (2, 8, 2, "dense"), (3, 10, 2, "dense")]


def test_reduce_dtype_sets_message_itemsize():
    p = plan(preset("seed-moe"), 8, "deepspeed-0.6", PlanOptions(reduce_dtype="bfloat16"))
    assert {c.itemsize for c in p.backward()} == {2}
    assert {c.itemsize for c in plan(preset("seed-moe"), 8, "deepspeed-0.6").backward()} == {4}


@pytest.mark.parametrize("strategy", ["deepspeed-0.6", "deepspeed"])
def test_split_by_group_keeps_the_schedule_on_single_group_buckets(strategy):
    whole = plan(preset("seed-moe"), 8, strategy)
    split = split_by_group(whole)
    assert [(c.op, c.group, c.root, c.offset, c.numel, c.segments) for c in split.backward()] == \
        [(c.op, c.group, c.root, c.offset, c.numel, c.segments) for c in whole.backward()]
    assert split.step() == whole.step() and split.layouts == whole.layouts
    for c in split.backward():
        (bucket,) = [b for b in split.buckets if (b.group, b.index) == (c.group, c.bucket)]
        assert {whole.locate(s.name)[0] for s in bucket.params} == {c.group}
    names = [s.name for b in split.buckets for s in b.params]
    assert sorted(names) == sorted(p.name for p in preset("seed-moe").params)
    if strategy == "deepspeed-0.6":
        assert [(b.group, b.index) for b in split.buckets] == [
            ("dense", 0), ("experts", 0), ("dense", 1)]


def test_split_deepspeed_plan_is_executable_by_the_runtime_routes():
    routes = pytest.importorskip("evenzero.runtime.routes")
    split = split_by_group(plan(preset("seed-moe"), 8, "deepspeed-0.6"))
    for rank in range(8):
        # Rank r's expert-DP group is {r % 4, r % 4 + 4}: group-local rank r // 4.
        assert len(routes.plan_routes(split, {"dense": rank, "experts": rank // 4})) == 3


@pytest.mark.parametrize("strategy", ["deepspeed-0.6", "deepspeed"])
def test_bad_input_is_rejected_with_a_fix(strategy):
    with pytest.raises(PlanError, match="multiple of 4"):
        plan(preset("seed-moe"), 6, strategy)
    with pytest.raises(PlanError, match="rename"):
        plan(spec_of({"a": 4}, groups=(GroupSpec("dense"), GroupSpec("ipg")),
                     group_of={"a": "ipg"}), 2, strategy)
    with pytest.raises(PlanError, match="no trainable parameters"):
        plan(ModelSpec(()), 2, strategy)
    with pytest.raises(PlanError, match="world size"):
        plan(preset("seed-moe"), 0, strategy)


@pytest.mark.parametrize("strategy", ["deepspeed-0.6", "deepspeed"])
def test_llama_70b_on_1024_ranks_plans_fast(strategy):
    spec = preset("llama-70b")
    start = time.perf_counter()
    p = plan(spec, 1024, strategy)
    elapsed = time.perf_counter() - start
    assert elapsed < 2.0, f"{strategy} took {elapsed:.2f}s"
    assert sum(c.numel for c in p.backward()) == spec.numel


def test_split_by_group_refuses_runs_that_merge_two_param_groups():
    # Two dense groups share DeepSpeed's DP process group, so adjacent slices of both
    # merge into one reduce; a per-group bucket would drop one group's gradients.
    from evenzero.plan import PlanError
    from evenzero.spec import GroupSpec, ModelSpec, ParamSpec
    from evenzero.strategies import plan
    from evenzero.strategies.executable import split_by_group

    spec = ModelSpec((ParamSpec("a", (8,), "dense"), ParamSpec("b", (8,), "nd")),
                     (GroupSpec("dense"), GroupSpec("nd")), ("b", "a"))
    with pytest.raises(PlanError, match="one param group per process group"):
        split_by_group(plan(spec, 1, "deepspeed-0.6"))
