"""The inner optimizer's implementation: evenzero's pick when the user made none, the
user's choice always, and every pick steps like torch's single-tensor loop."""

from __future__ import annotations

import pytest
import torch

from evenzero.runtime import ZeroConfig, ZeroConfigError
from evenzero.runtime.innerstep import (
    FASTEST_ON_CPU,
    FOREACH,
    FUSED,
    SINGLE_TENSOR,
    choose_inner_step,
    plan_note,
)

CPU = torch.device("cpu")
AdamW = torch.optim.AdamW


def choose(cls=AdamW, kwargs=None, groups=({},), device=CPU, dtype=torch.float32, requested=None):
    return choose_inner_step(cls, kwargs or {"lr": 1e-3}, groups, device, dtype, requested)


def test_cpu_fp32_shards_get_the_fastest_implementation_measured():
    step = choose()
    assert (step.impl, step.chosen) == (FUSED, True)
    assert step.kwargs == {"lr": 1e-3, "fused": True}
    assert choose(torch.optim.RAdam).kwargs == {"lr": 1e-3, "foreach": True}
    assert choose(torch.optim.SGD, dtype=torch.float64).impl == FUSED


@pytest.mark.parametrize("case", [
    {"kwargs": {"lr": 1e-3, "foreach": False}},                 # the opt-out
    {"kwargs": {"lr": 1e-3, "fused": False}},
    {"kwargs": {"lr": 1e-3, "foreach": True}},
    {"groups": ({}, {"foreach": False})},                        # in one parameter group
    {"kwargs": {"lr": 1e-3, "differentiable": True}},
    {"dtype": torch.bfloat16},                                   # fused computes it in fp32
    {"cls": torch.optim.Adamax},                                 # not faster: torch's default
    {"cls": type("MyAdamW", (AdamW,), {})},                      # a subclass may override step
    {"device": torch.device("cuda", 0)},                         # torch picks foreach there
])
def test_the_user_or_torch_decides_otherwise(case):
    kwargs = case.get("kwargs", {"lr": 1e-3})
    step = choose(**case)
    assert not step.chosen
    assert step.kwargs == kwargs, "the user's arguments pass through untouched"


def test_the_implementation_torch_will_run_is_named():
    assert choose(kwargs={"foreach": False}).impl == SINGLE_TENSOR
    assert choose(kwargs={"fused": False}).impl == SINGLE_TENSOR
    assert choose(kwargs={"fused": True}).impl == FUSED
    assert choose(torch.optim.Adamax).impl == SINGLE_TENSOR
    assert choose(device=torch.device("cuda", 0)).impl == FOREACH
    assert choose(groups=({"foreach": True}, {"foreach": False})).impl is None  # differ


def test_optimizer_impl_requests_an_implementation():
    assert choose(requested=SINGLE_TENSOR).kwargs == {"lr": 1e-3, "foreach": False}
    assert choose(requested=FOREACH).kwargs == {"lr": 1e-3, "foreach": True}
    step = choose(kwargs={"lr": 1e-3, "fused": True}, requested=FUSED)  # agreeing is fine
    assert step.kwargs["fused"] and step.impl == FUSED
    with pytest.raises(ZeroConfigError, match="contradicts"):
        choose(kwargs={"lr": 1e-3, "foreach": True}, requested=FUSED)
    with pytest.raises(ZeroConfigError, match="Adamax has no 'fused'"):
        choose(torch.optim.Adamax, requested=FUSED)
    with pytest.raises(ZeroConfigError, match="optimizer_impl must be one of"):
        ZeroConfig(optimizer_impl="apex")


def test_the_plan_note_names_the_implementation_and_the_opt_out():
    note = plan_note(FUSED)
    assert "fused" in note and "single_tensor" in note
    assert plan_note(None) is None


@pytest.mark.parametrize("cls", list(FASTEST_ON_CPU), ids=lambda c: c.__name__)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_each_pick_steps_a_flat_shard_like_the_single_tensor_loop(cls, dtype):
    """Also what the masked step relies on: the pick steps any flat tensor it is given."""
    kwargs = {"lr": 1e-2}
    if cls in (torch.optim.AdamW, torch.optim.Adam):
        kwargs["weight_decay"] = 0.1
    if cls is torch.optim.SGD:
        kwargs["momentum"] = 0.9
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(1000, generator=gen, dtype=dtype)
    grads = [torch.randn(1000, generator=gen, dtype=dtype) for _ in range(3)]
    results = []
    for extra in ({"foreach": False}, choose(cls, kwargs, dtype=dtype).kwargs):
        p = torch.nn.Parameter(start.clone())
        opt = cls([p], **{**kwargs, **extra})
        for g in grads:
            p.grad = g.clone()
            opt.step()
        results.append(p.detach())
    torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", ["AdamW", "Adam-amsgrad", "SGD-momentum", "SGD-nesterov",
                                  "Adagrad", "RMSprop", "NAdam", "RAdam"])
@pytest.mark.parametrize("world,rank,bucket", [(1, 0, 1000), (3, 1, 16)])
def test_the_masked_step_runs_each_pick_like_torch_per_parameter(name, world, rank, bucket):
    """Absent parameters, classes of different step counts and gathered copies of odd
    classes (`runtime/maskedstep.py`) under the fused/foreach pick, against torch's
    single-tensor loop on the separate parameters."""
    from evenzero.runtime.maskedstep import MaskedStep
    from evenzero.runtime.shardruns import ShardRuns
    from test_runtime_maskedstep import OPTIMIZERS, PRESENCE, SHAPES, _gather, _plan

    cls, kw = OPTIMIZERS[name]
    pick = choose(cls, kw)
    assert pick.chosen, "only the classes evenzero picks for are listed"
    gen = torch.Generator().manual_seed(0)
    init = {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}
    ref = {n: torch.nn.Parameter(v.clone()) for n, v in init.items()}
    ref_opt = cls(list(ref.values()), **kw, foreach=False)
    p = _plan(world, bucket)
    ranges = p.shard_ranges("dense", rank)
    master = torch.nn.Parameter(_gather(p, ranges, init))
    stepper = MaskedStep(cls([master], **pick.kwargs), [master], ShardRuns.of(p, "dense", rank))
    for step, present in enumerate(PRESENCE):
        grads = {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}
        for n, prm in ref.items():
            prm.grad = grads[n].clone() if n in present else None
        ref_opt.step()
        stepper.step([_gather(p, ranges, grads)], present)
        want = _gather(p, ranges, {n: v.detach() for n, v in ref.items()})
        torch.testing.assert_close(master.detach(), want, rtol=1e-6, atol=1e-6,
                                   msg=lambda m, s=step: f"step {s}: {m}")


def test_the_groups_show_the_users_implementation_keys_not_evenzeros():
    from evenzero.runtime.innerstep import keeps_inner_choice, user_defaults

    inner = {"lr": 1e-3, "foreach": None, "fused": True, "maximize": False}
    assert user_defaults(inner, {"lr": 1e-3}) == {**inner, "fused": None}
    assert user_defaults(inner, {"fused": True})["fused"] is True
    # A group left at torch's default keeps the inner choice; a value the user sets is
    # passed on, as torch reads it at each step.
    assert keeps_inner_choice("fused", None) and keeps_inner_choice("foreach", None)
    assert not keeps_inner_choice("fused", False) and not keeps_inner_choice("lr", None)
