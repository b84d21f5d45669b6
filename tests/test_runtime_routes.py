"""Per-rank routes through a plan, and the engine's configuration rules (no processes)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from evenzero.model_presets import preset
from evenzero.plan import PlanError
from evenzero.runtime.checks import ZeroConfigError
from evenzero.runtime.collectives import default_reduce_scatter_algorithm
from evenzero.runtime.config import ELEMENTWISE_OPTIMIZERS, ZeroConfig, check_elementwise
from evenzero.runtime.routes import plan_routes, unreduced
from evenzero.spec import GroupSpec, ModelSpec, ParamSpec
from evenzero.strategies import PlanOptions, plan
from evenzero.strategies.executable import split_by_group


@st.composite
def specs(draw):
    world = draw(st.sampled_from([1, 2, 3, 4, 6, 8]))
    ep = draw(st.sampled_from([e for e in (1, 2, 4) if world % e == 0]))
    n = draw(st.integers(1, 10))
    params = []
    for i in range(n):
        shape = tuple(draw(st.lists(st.integers(1, 9), min_size=1, max_size=2)))
        group = "experts" if ep > 1 and draw(st.booleans()) else "dense"
        params.append(ParamSpec(f"p{i}", shape, group))
    groups = (GroupSpec("dense"),) + ((GroupSpec("experts", ep),) if ep > 1 else ())
    if not any(p.group == "dense" for p in params):
        params[0] = dataclasses.replace(params[0], group="dense")
    names = [p.name for p in params]
    arrival = draw(st.permutations(names))
    dropped = draw(st.integers(0, len(names) - 1))
    spec = ModelSpec(tuple(params), groups, tuple(arrival[dropped:]))
    return spec, world, draw(st.integers(4, 120))


@settings(max_examples=60, deadline=None)
@given(specs())
def test_evenzero_routes_are_direct_and_every_element_has_exactly_one_owner(case):
    spec, world, bucket = case
    p = plan(spec, world, "evenzero", PlanOptions(bucket_numel=bucket))
    for rank in range(world):
        ranks = {g.name: g.ranks_of(rank, world).index(rank) for g in p.groups}
        for route in plan_routes(p, ranks):
            assert route.direct_shard_offset is not None
            used = route.bucket.used
            assert route.gaps == (((used, route.bucket.numel - used),) if route.bucket.padding else ())
    _assert_single_owner(p, world)


@settings(max_examples=60, deadline=None)
@given(specs())
def test_deepspeed_routes_deliver_every_owned_element(case):
    spec, world, bucket = case
    p = split_by_group(plan(spec, world, "deepspeed-0.6", PlanOptions(bucket_numel=bucket)))
    _assert_single_owner(p, world, skip=set(unreduced(p)))
    assert set(unreduced(p)) == {n.name for n in spec.params} - set(spec.arrival_order)


def _assert_single_owner(p, world, skip=frozenset()):
    """Within each replica (the ranks sharing an expert-parallel index), every element of
    every reduced parameter is owned by exactly one group rank."""
    for g in p.groups:
        e = g.expert_parallel_size
        for replica in range(e):
            seen: dict[tuple[str, int], int] = {}
            for rank in range(replica, world, e):
                group_rank = g.ranks_of(rank, world).index(rank)
                routes = plan_routes(p, {x.name: x.ranks_of(rank, world).index(rank) for x in p.groups})
                for route in routes:
                    if route.bucket.group != g.name:
                        continue
                    for piece in route.owned:
                        for slot in route.bucket.params:
                            lo = max(piece.bucket_offset, slot.offset)
                            hi = min(piece.bucket_offset + piece.numel, slot.offset + slot.numel)
                            for k in range(lo - slot.offset, hi - slot.offset):
                                assert (slot.name, k) not in seen, (slot.name, k)
                                seen[(slot.name, k)] = group_rank
            expected = {(s.name, k) for lay in p.group_layouts(g.name) for s in lay.params
                        if s.name not in skip for k in range(s.numel)}
            assert set(seen) == expected


def test_seed_case_deepspeed_routes_have_pieces_not_a_direct_slice():
    p = split_by_group(plan(preset("seed-moe"), 8, "deepspeed-0.6"))
    routes = plan_routes(p, {"dense": 7, "experts": 1})
    assert [r.direct_shard_offset for r in routes] == [None] * len(routes)
    assert sum(len(r.collectives) for r in routes) == 14  # 13 reduces + the gate's
    dense = plan_routes(plan(preset("seed-moe"), 8, "evenzero"), {"dense": 7, "experts": 1})
    assert all(r.direct_shard_offset is not None for r in dense)


def test_a_plan_that_reduces_to_the_wrong_root_is_rejected():
    spec = ModelSpec((ParamSpec("a", (8,)), ParamSpec("b", (8,))))
    p = split_by_group(plan(spec, 2, "deepspeed-0.6"))
    wrong = tuple(dataclasses.replace(c, root=1 - c.root) if c.op == "reduce" else c
                  for c in p.collectives)
    with pytest.raises(PlanError, match="does not deliver elements"):
        plan_routes(dataclasses.replace(p, collectives=wrong), {"dense": 0})


def test_collectives_out_of_bucket_order_are_rejected():
    spec = ModelSpec(tuple(ParamSpec(f"p{i}", (16,)) for i in range(4)))
    p = plan(spec, 2, "evenzero", PlanOptions(bucket_numel=16))
    assert len(p.buckets) == 4
    backward = p.backward()
    swapped = (backward[1], backward[0], *backward[2:])
    with pytest.raises(PlanError, match="plan order"):
        plan_routes(dataclasses.replace(p, collectives=swapped + p.step()), {"dense": 0})


def test_a_non_reducing_backward_collective_is_rejected():
    spec = ModelSpec((ParamSpec("a", (8,)),))
    p = plan(spec, 2, "evenzero")
    gathered = tuple(dataclasses.replace(c, op="all_gather") for c in p.backward())
    with pytest.raises(PlanError, match="executes only"):
        plan_routes(dataclasses.replace(p, collectives=gathered), {"dense": 0})


def test_reduce_scatter_algorithm_follows_the_backend():
    assert default_reduce_scatter_algorithm("gloo") == "all_to_all+sum"
    assert default_reduce_scatter_algorithm("nccl", "cuda") == "reduce_scatter_tensor"
    assert default_reduce_scatter_algorithm("cpu:gloo,cuda:nccl", "cuda") == "reduce_scatter_tensor"
    assert default_reduce_scatter_algorithm("cpu:gloo,cuda:nccl", "cpu") == "all_to_all+sum"


@pytest.mark.parametrize("kwargs, fragment", [
    ({"stage": 3}, "stage must be 1 or 2"),
    ({"bucket_numel": 0}, "bucket_numel must be \"auto\" or a positive integer"),
    ({"reduce_scatter_algorithm": "ring"}, "reduce_scatter_algorithm must be one of"),
    ({"loss_scale": "auto"}, "loss_scale must be 'dynamic'"),
    ({"reduce_dtype": "int8"}, "unknown dtype 'int8'"),
    ({"strategy": 3}, "strategy must be a strategy name"),
    ({"stage": True}, "stage must be 1 or 2"),
    ({"bucket_numel": 100.0}, "bucket_numel must be \"auto\" or a positive integer"),
    ({"max_buckets_in_flight": 1.5}, "max_buckets_in_flight must be an integer"),
    ({"max_buckets_in_flight": 0}, "max_buckets_in_flight must be an integer of at least 1"),
    ({"max_buckets_in_flight": True}, "max_buckets_in_flight must be an integer"),
    ({"alignment_bytes": 3}, "alignment_bytes must be a power of two"),
    ({"alignment_bytes": 0}, "alignment_bytes must be a power of two"),
    ({"alignment_bytes": 64.0}, "alignment_bytes must be a power of two"),
    ({"loss_scale": float("inf")}, r"loss_scale must be .*finite positive.*e\.g\."),
    ({"loss_scale": float("nan")}, "loss_scale must be"),
    ({"loss_scale": -2.0}, "loss_scale must be"),
    ({"loss_scale": True}, "loss_scale must be"),
    ({"loss_scale_config": {"init_scale": 2.0}}, "loss_scale_config must be"),
    ({"allow_partial_grads": "yes"}, "allow_partial_grads must be True or False"),
    ({"overlap_param_gather": 1}, "overlap_param_gather must be True or False"),
    ({"elementwise": "sure"}, "elementwise must be True, False or None"),
])
def test_bad_config_names_the_field(kwargs, fragment):
    with pytest.raises(ZeroConfigError, match=fragment):
        ZeroConfig(**kwargs)


@pytest.mark.parametrize("kwargs, fragment", [
    ({"init_scale": float("inf")}, "init_scale must be a finite positive number"),
    ({"init_scale": 0.0}, "init_scale must be a finite positive number"),
    ({"min_scale": float("nan")}, "min_scale must be a finite positive number"),
    ({"growth_factor": 0.5}, "growth_factor must be >= 1"),
    ({"backoff_factor": 1.0}, r"backoff_factor must be in \(0, 1\)"),
    ({"growth_interval": 1.5}, "growth_interval must be an integer"),
    ({"growth_interval": 0}, "growth_interval must be an integer >= 1"),
])
def test_bad_loss_scale_config_is_a_config_error(kwargs, fragment):
    from evenzero.runtime import LossScaleConfig

    with pytest.raises(ZeroConfigError, match=fragment):
        LossScaleConfig(**kwargs)


def test_good_configs_are_accepted():
    from evenzero.runtime import LossScaleConfig

    ZeroConfig(stage=1, bucket_numel=2**20, alignment_bytes=256, max_buckets_in_flight=4,
               loss_scale=1024, loss_scale_config=LossScaleConfig(growth_interval=10))
    ZeroConfig(loss_scale=0.5, reduce_dtype="bf16", elementwise=True)


def test_only_elementwise_optimizers_step_shards():
    for cls in ELEMENTWISE_OPTIMIZERS:
        check_elementwise(cls, None)
    for cls in (torch.optim.LBFGS, torch.optim.SparseAdam):
        with pytest.raises(ZeroConfigError, match=f"{cls.__name__} is not a known elementwise"):
            check_elementwise(cls, None)

    class Custom(torch.optim.Optimizer):
        pass

    with pytest.raises(ZeroConfigError, match="elementwise=True"):
        check_elementwise(Custom, None)
    check_elementwise(Custom, True)
    with pytest.raises(ZeroConfigError, match="torch.optim.Optimizer subclass"):
        check_elementwise(lambda params: None, None)
