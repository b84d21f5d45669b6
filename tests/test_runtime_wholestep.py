"""Whole-tensor inner optimizers (torch.optim.Muon) under ZeroOptimizer: each owner steps
complete, reduced matrices; training equals single-process torch Muon + AdamW."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from dist_helpers import CheckResults, run_checks
from muon_models import MUON, Reference, TinyLlama, llama_batch, llama_loss, muon_groups


def train(rank, world, steps, per_rank=2, **engine):
    from evenzero import ZeroOptimizer

    torch.manual_seed(0)
    model = TinyLlama()
    ref = Reference(model)
    opt = ZeroOptimizer(model, torch.optim.Muon, muon_groups(model), **MUON, **engine)
    for step in range(steps):
        batch = llama_batch(step, per_rank * world)
        parts = list(batch.split(per_rank))
        llama_loss(model, parts[rank]).backward()
        opt.step()
        opt.zero_grad()
        ref.step(parts)
    opt.wait_for_params()
    return model, ref.model, opt


def assert_close(model, ref, atol=1e-6):
    want = dict(ref.named_parameters())
    worst = max((p.detach() - want[n].detach()).abs().max().item()
                for n, p in model.named_parameters())
    assert worst <= atol, f"largest difference {worst:.3g}"


def check_equal_to_torch(rank, world):
    model, ref, opt = train(rank, world, steps=20, bucket_numel=4096)
    assert_close(model, ref)
    # every matrix of the Muon group has one owner, and the owner steps it whole
    muon = opt.plan.groups[0].name
    owners = {}
    for r in range(world):
        for s in opt.plan.shard_ranges(muon, r):
            owners.setdefault(s.param, set()).add(r)
    assert all(len(v) == 1 for v in owners.values()), owners
    assert opt.inner_optimizer_class is torch.optim.Muon


def check_same_collectives_as_adamw(rank, world):
    _, _, opt = train(rank, world, steps=2, bucket_numel=4096)
    plan = opt.plan
    back = plan.backward()
    trace = opt.trace
    # one equal reduce-scatter per bucket, then the step check and one gather per layout
    assert trace[:len(back)] == back
    assert trace[len(back):] == plan.step()
    assert [c.op for c in back] == ["reduce_scatter"] * len(plan.buckets)
    assert [c.op for c in plan.step()] == ["all_reduce"] + ["all_gather"] * len(plan.layouts)
    assert all(c.numel % world == 0 for c in back)


CHECKS = {"equal_to_torch": check_equal_to_torch,
          "same_collectives_as_adamw": check_same_collectives_as_adamw}


def muon_job(rank: int, world: int) -> dict[str, str | None]:
    return run_checks({name: partial(check, rank, world) for name, check in CHECKS.items()})


RESULTS = CheckResults(muon_job, timeout=240)


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow),
                                   pytest.param(8, marks=pytest.mark.slow)])
@pytest.mark.parametrize("check", list(CHECKS))
def test_muon_under_zero(world, check):
    RESULTS.assert_passed(check, world)
