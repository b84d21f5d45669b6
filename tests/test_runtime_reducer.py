"""The gradient reducer without processes: a fake reduce-scatter records what is issued
and waited for, so the ordering rules are pinned exactly."""

from __future__ import annotations

import pytest
import torch

from evenzero.runtime.collectives import ReduceScatter, TraceRecorder
from evenzero.runtime.executors import LocalSync, collective_executor_for, executor_for
from evenzero.runtime.gradclear import ClearTracker
from evenzero.runtime.reducer import GradientReducer, ReducerConfig, keeps_pool
from evenzero.runtime.routes import plan_routes
from evenzero.runtime.shardedgrad import ShardedGrad, placeholders
from evenzero.runtime.shardruns import ShardRuns
from evenzero.runtime.shards import GroupShard, Placement
from evenzero.spec import ModelSpec, ParamSpec
from evenzero.strategies import PlanOptions, plan

NAMES = ("p0", "p1", "p2", "p3")


class FakeWork:
    def __init__(self, log: list, bucket: int, output: torch.Tensor, message: torch.Tensor) -> None:
        self.log, self.bucket, self.output, self.message = log, bucket, output, message

    def wait(self) -> None:
        # A one-rank reduce-scatter: this rank's chunk is the whole message.
        self.output.copy_(self.message)
        self.log.append(("wait", self.bucket))


class FakeReduceScatter(ReduceScatter):
    """Records every launch; the bucket is told apart by its first element."""

    name = "fake"

    def __init__(self) -> None:
        self.log: list[tuple[str, int]] = []

    def scratch_numel(self, message_numel: int, group_size: int) -> int:
        return message_numel

    def __call__(self, output, message, group):
        bucket = int(message[0].item())
        self.log.append(("launch", bucket))
        return FakeWork(self.log, bucket, output, message)

    def chunk(self, output, group_size, sum_dtype):
        return output.to(sum_dtype)


def make_reducer(max_in_flight: int = 2, stage: int = 2, keep_pool: bool = False,
                 local: bool = False):
    """Four 4-element params on one rank, two per bucket: bucket 0 holds p3, p2 (the
    assumed arrival order is reverse registration), bucket 1 holds p1, p0. The fake
    reduce-scatter stands in for the other ranks, so the executors that issue
    collectives run, not the group of one's local one (`local=True`: that one)."""
    spec = ModelSpec(tuple(ParamSpec(n, (4,)) for n in NAMES))
    p = plan(spec, 1, "evenzero", PlanOptions(bucket_numel=8, alignment_bytes=4))
    assert [[s.name for s in b.params] for b in p.buckets] == [["p3", "p2"], ["p1", "p0"]]
    params = {n: torch.nn.Parameter(torch.zeros(4)) for n in NAMES}
    n = p.shard_numel("dense")
    group = GroupShard("dense", None, 1, 0, torch.float32, torch.float32, torch.float32, {},
                       Placement.on(torch.device("cpu")))
    group.grad = torch.zeros(n)
    rs = FakeReduceScatter()
    trace = TraceRecorder()
    tracker = ClearTracker(params, placeholders(list(params.items())))
    reducer = GradientReducer(plan_routes(p, {"dense": 0}), params, {"dense": group},
                              ReducerConfig(stage, 1, max_in_flight, torch.device("cpu"), rs,
                                            keep_pool=keep_pool),
                              trace, tracker, {"dense": ShardRuns.of(p, "dense", 0)},
                              make_executor=executor_for if local else collective_executor_for)
    return reducer, params, group, rs, trace, p


def give_grad(params, name: str) -> None:
    # Each bucket's first element names the bucket (p3 leads bucket 0, p1 bucket 1).
    value = {"p3": 0.0, "p1": 1.0}.get(name, 10.0 + NAMES.index(name))
    params[name].grad = torch.full((4,), value)


def test_a_complete_bucket_waits_behind_an_incomplete_one():
    reducer, params, _, rs, _, _ = make_reducer()
    for name in ("p1", "p0", "p3"):  # bucket 1 complete, bucket 0 still missing p2
        give_grad(params, name)
        reducer.grad_ready(name)
    assert rs.log == [], "bucket 1 must not go before bucket 0 on any rank"
    give_grad(params, "p2")
    reducer.grad_ready("p2")
    assert rs.log == [("launch", 0), ("launch", 1)]
    assert reducer.finish_grad_sync() == []
    assert rs.log[2:] == [("wait", 0), ("wait", 1)]


@pytest.mark.parametrize("limit, expected", [
    (1, [("launch", 0), ("wait", 0), ("launch", 1), ("wait", 1)]),
    (2, [("launch", 0), ("launch", 1), ("wait", 0), ("wait", 1)]),
])
def test_max_buckets_in_flight_bounds_outstanding_buckets(limit, expected):
    reducer, params, _, rs, _, _ = make_reducer(max_in_flight=limit)
    for name in ("p3", "p2", "p1", "p0"):
        give_grad(params, name)
        reducer.grad_ready(name)
    reducer.finish_grad_sync()
    assert rs.log == expected
    assert reducer.pool.nbytes() == 0, "the pool is freed after backward"


def test_pool_is_kept_between_backwards_only_when_asked():
    assert keeps_pool(torch.device("cpu")) and not keeps_pool(torch.device("cuda", 0))
    reducer, params, *_ = make_reducer(keep_pool=True)
    arenas = []
    for _ in range(2):
        for name in ("p3", "p2", "p1", "p0"):
            give_grad(params, name)
            reducer.grad_ready(name)
        reducer.finish_grad_sync()
        assert reducer.pool.nbytes() > 0, "kept for the next backward"
        arenas.append(sorted(s.arena.data_ptr() for s in reducer.pool._all))
    assert arenas[0] == arenas[1], "the next backward reuses the same arenas"


def test_reduced_gradients_land_in_the_shard_and_grads_are_dropped():
    reducer, params, group, _, trace, p = make_reducer()
    for name in NAMES:
        give_grad(params, name)
        reducer.grad_ready(name)
    assert reducer.finish_grad_sync() == []
    for r in p.shard_ranges("dense", 0):
        want = params[r.param].new_full((r.numel,), {"p3": 0.0, "p1": 1.0}.get(
            r.param, 10.0 + NAMES.index(r.param)))
        torch.testing.assert_close(group.grad[r.shard_offset:r.shard_offset + r.numel], want)
    assert all(isinstance(q.grad, ShardedGrad) for q in params.values()), \
        "stage 2 keeps no full gradient"
    assert tuple(trace.pending) == p.backward()
    assert {c.algorithm for c in trace.pending} == {"fake"}


def test_missing_gradients_are_reduced_as_zeros_at_the_end():
    reducer, params, group, rs, _, _ = make_reducer()
    give_grad(params, "p1")
    reducer.grad_ready("p1")
    assert reducer.finish_grad_sync() == []
    # Bucket 0 has no gradient at all and goes first anyway, as zeros.
    assert [e for e in rs.log if e[0] == "launch"] == [("launch", 0), ("launch", 1)]
    assert group.grad.abs().sum() == 4.0  # p1's four ones; everything else zero


def test_a_late_gradient_is_named_after_the_collectives():
    reducer, params, _, rs, _, _ = make_reducer()
    for name in ("p3", "p2"):
        give_grad(params, name)
        reducer.grad_ready(name)
    assert ("launch", 0) in rs.log
    give_grad(params, "p3")
    reducer.grad_ready("p3")  # p3 again, after its bucket was launched
    problems = reducer.finish_grad_sync()
    assert len(problems) == 1 and "'p3' arrived after its bucket was reduced" in problems[0]
    assert "use_reentrant=False" in problems[0]
    assert [e[0] for e in rs.log].count("launch") == 2, "every bucket is still reduced"


def test_a_gradient_the_plan_has_no_collective_for_is_named():
    reducer, params, _, _, _, _ = make_reducer()
    reducer.grad_ready("not_planned")
    problems = reducer.finish_grad_sync()
    assert problems and "'not_planned' arrived, but the plan has no collective" in problems[0]


def test_stage1_accumulates_into_persistent_buffers():
    reducer, params, group, rs, _, _ = make_reducer(stage=1)
    views = reducer.grad_buffers.views
    for name in NAMES:
        give_grad(params, name)
        reducer.grad_ready(name)
    reducer.finish_grad_sync()
    # .grad is the placeholder, whose landing is the bucket buffer (zeroed after the
    # reduction): the next backward's gradient lands there and accumulates in place.
    assert isinstance(params["p3"].grad, ShardedGrad)
    assert params["p3"].grad.landing.data_ptr() == views[0][0].data_ptr()
    assert reducer.held_grads() == {v.data_ptr() for vs in views for v in vs}
    assert group.grad.abs().sum() > 0
    assert all(b.abs().sum() == 0 for b in reducer.grad_buffers.buffers)
    # Gradients the user did not clear are accumulated onto the shard next time.
    before = group.grad.clone()
    q = params["p0"]
    (q * 2).sum().backward()
    assert q.grad.data_ptr() == views[1][1].data_ptr()
    reducer.clearing.accumulated("p0")  # what the engine's post-accumulate hook reports
    reducer.grad_ready("p0")
    reducer.finish_grad_sync()
    (off, n), = reducer.runs["dense"].runs["p0"]
    torch.testing.assert_close(group.grad[off:off + n], before[off:off + n] + 2)


def test_cleared_gradients_overwrite_their_runs():
    reducer, params, group, _, _, p = make_reducer()
    for name in NAMES:
        give_grad(params, name)
        reducer.grad_ready(name)
    reducer.finish_grad_sync()
    params["p1"].grad = None  # cleared: its runs are overwritten, the others accumulate
    before = group.grad.clone()
    for name in NAMES:
        reducer.grad_ready(name)
    reducer.finish_grad_sync()
    runs = reducer.runs["dense"]
    for name in NAMES:
        (off, n), = runs.runs[name]
        want = torch.zeros(n) if name == "p1" else before[off:off + n]
        torch.testing.assert_close(group.grad[off:off + n], want, msg=name)


@pytest.mark.parametrize("stage", [1, 2])
def test_a_group_of_one_issues_nothing_and_stage2_needs_no_bucket(stage):
    reducer, params, group, rs, trace, p = make_reducer(stage=stage, local=True)
    assert all(isinstance(ex, LocalSync) for ex in reducer.executors)
    for step in range(2):
        for name in NAMES:
            give_grad(params, name)
            reducer.grad_ready(name)
        assert reducer.finish_grad_sync() == []
        if step == 0:
            first = group.grad.clone()
    assert rs.log == [], "nothing issued"
    assert {c.algorithm for c in trace.pending} == {"local"}
    assert tuple(trace.pending) == p.backward() * 2
    # The second backward replaced .grad (the user's assignment clears, as in torch).
    torch.testing.assert_close(group.grad, first)
    for r in p.shard_ranges("dense", 0):
        want = {"p3": 0.0, "p1": 1.0}.get(r.param, 10.0 + NAMES.index(r.param))
        torch.testing.assert_close(group.grad[r.shard_offset:r.shard_offset + r.numel],
                                   torch.full((r.numel,), want))
    if stage == 2:
        assert reducer.pool.nbytes() == 0 and reducer.pool.arena_numel == {}


def test_a_group_of_one_accumulates_kept_gradients_and_overwrites_cleared_ones():
    reducer, params, group, _, _, _ = make_reducer(local=True)
    for name in NAMES:
        give_grad(params, name)
        reducer.grad_ready(name)
    reducer.finish_grad_sync()
    before = group.grad.clone()
    params["p1"].grad = None          # cleared, no new gradient: zeros
    params["p2"].grad.zero_()         # cleared in place, new gradient: overwritten
    for name in ("p0", "p2", "p3"):   # p0, p3 kept: a new gradient adds
        q = params[name]
        (q * 3).sum().backward()
        reducer.clearing.accumulated(name)
        reducer.grad_ready(name)
    reducer.finish_grad_sync()
    runs = reducer.runs["dense"].runs
    for name, want in (("p0", before), ("p3", before), ("p1", None), ("p2", None)):
        (off, n), = runs[name]
        expect = torch.zeros(n) if name == "p1" else (
            torch.full((n,), 3.0) if name == "p2" else want[off:off + n] + 3)
        torch.testing.assert_close(group.grad[off:off + n], expect, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_bucketless_accumulation_equals_the_bucket_path(dtype):
    """LocalSync.accumulate_grads (gradients straight into the fp32 shard) gives the
    same bits as filling a bucket and accumulating it, for any parameter dtype, with a
    loss scale and cleared, kept and missing gradients."""
    spec = ModelSpec(tuple(ParamSpec(n, (4,), dtype=str(dtype).split(".")[1]) for n in NAMES))
    p = plan(spec, 1, "evenzero", PlanOptions(bucket_numel=16, alignment_bytes=4))
    route, = plan_routes(p, {"dense": 0})
    n = p.shard_numel("dense")
    group = GroupShard("dense", None, 1, 0, dtype, dtype, torch.float32, {},
                       Placement.on(torch.device("cpu")))
    ex = LocalSync(route, group)
    assert ex.bucketless
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(n, generator=gen)
    # cleared with a gradient, kept with one, cleared without, kept without
    grads = [torch.randn(4, generator=gen).to(dtype), torch.randn(4, generator=gen).to(dtype),
             None, None]
    cleared = [True, False, True, False]
    direct = start.clone()
    ex.accumulate_grads(grads, cleared, direct, 0.25)
    bucket = torch.zeros(route.bucket.numel, dtype=dtype)
    for s, g in zip(route.bucket.params, grads, strict=True):
        if g is not None:
            bucket[s.offset:s.offset + s.numel] = g
    runs = ShardRuns.of(p, "dense", 0)
    names = [s.name for s, c in zip(route.bucket.params, cleared, strict=True) if c]
    via_bucket = start.clone()
    ex.finish_grad_sync(None, bucket, via_bucket, 0.25, runs.of_params(names))
    assert torch.equal(direct, via_bucket), (direct, via_bucket)
    assert not torch.equal(direct, start)
